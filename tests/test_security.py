"""Security: nothing from data escapes the storage root, no credential reaches any output, no pickle or
``torch.load`` of untrusted bytes, asset outputs that Dagster pickles are small plain references."""
from __future__ import annotations

import json
import os
import pickle
import re
import uuid

import dagster as dg
import pytest
from pipeline_helpers import local_resources, run_assets

from batchrl.resources import CatalogResource, LandingResource, StorageResource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = ["raw_logs", "cleaned_logs", "validated_preferences"]


# -- path traversal -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", "../escape", "a/../../b", "/abs", "x\\..\\y", "nul\0", "s3:", " pad"])
def test_storage_refuses_names_that_leave_the_root(tmp_path, name):
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "root" / "_cache"))
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    (staging / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="unsafe"):
        storage.publish(str(staging), name, {})
    with pytest.raises(ValueError, match="unsafe"):
        with storage.staging_dir(name):
            pass
    with pytest.raises(ValueError, match="unsafe"):
        storage.localize({"asset": name, "uri": str(tmp_path), "data_version": "v"})
    with pytest.raises(ValueError, match="unsafe"):
        storage.localize({"asset": "a", "uri": str(tmp_path), "data_version": name})
    with pytest.raises(ValueError, match="unsafe"):
        storage.publish(str(staging), "ok", {}, sidecars={name: {}})
    escaped = [p for p in tmp_path.rglob("*") if "root" not in p.parts and "staging" not in p.parts]
    assert escaped == []


def test_a_tampered_reference_cannot_point_outside_the_root(tmp_path):
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "root" / "_cache"))
    with pytest.raises(ValueError, match="outside the storage root"):
        storage.localize({"asset": "cleaned_logs", "uri": "/etc", "data_version": "0123"})
    with pytest.raises(ValueError, match="outside the storage root"):
        storage.read_lineage({"asset": "a", "uri": str(tmp_path / "root" / ".." / "elsewhere"), "data_version": "v"})


HOSTILE_NAMES = ["x..%2F..jsonl", "-rf.jsonl", "$(touch pwned).jsonl", "semi;colon `x`.jsonl", "quote'\".jsonl",
                 "spaces and ünïcödé.jsonl"]
HOSTILE_VALUES = ["../../../../etc/passwd", "/tmp/pwned", "..", "C:\\Windows\\x", "'; DROP TABLE artifacts; --"]


def test_hostile_file_names_and_fields_stay_data(tmp_path):
    """Landing file names and field values that look like paths, shell or SQL: the run succeeds, every
    file it writes is under the storage root, and the values come out unchanged, as data."""
    landing = tmp_path / "landing"
    landing.mkdir()
    for k, name in enumerate(HOSTILE_NAMES):
        rows = [{"prompt": f"q{k}-{i}", "chosen": "a", "rejected": "b", "id": v, "category": v, "source": v}
                for i, v in enumerate(HOSTILE_VALUES)]
        (landing / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    root = tmp_path / "root"
    before = set(os.listdir(tmp_path))
    with dg.DagsterInstance.ephemeral() as instance:
        result = run_assets(local_resources(str(root), LandingResource(preferences=str(landing))), instance,
                            selection=DATA)
        assert result.success
        assert instance.get_dynamic_partitions("log_drops") == sorted(HOSTILE_NAMES)  # each file is a drop
    assert set(os.listdir(tmp_path)) - before == {"root"}
    assert not any(p.name == "pwned" for p in tmp_path.rglob("*")) and not os.path.exists("pwned")
    import pyarrow.parquet as pq

    versions = os.listdir(root / "validated_preferences")
    table = [row for version in versions
             for row in pq.read_table(root / "validated_preferences" / version / "preferences.parquet").to_pylist()]
    assert {r["id"] for r in table} == set(HOSTILE_VALUES) and len(table) == len(HOSTILE_NAMES) * len(HOSTILE_VALUES)
    assert {os.path.basename(r["source_file"]) for r in table} == set(HOSTILE_NAMES)
    catalog = CatalogResource(path=str(root / "catalog.duckdb"))
    assert catalog.query("SELECT count(*) FROM artifacts") == [(3 * len(HOSTILE_NAMES),)]  # the SQL did nothing


# -- credentials ----------------------------------------------------------------------------------------------
def _files_holding(folder, needles: list[bytes]) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                data = open(path, "rb").read()
            except OSError:
                continue
            if any(n in data for n in needles):
                hits.append(path)
    return hits


def test_planted_credentials_reach_no_output(s3_server, tmp_path, monkeypatch):
    """A secret key in the environment and, by mistake, in the resources' storage_options: after an S3
    run, no artifact, lineage, sidecar, catalog row, Dagster event or log, or S3 object contains it. The
    outputs that Dagster's IO manager pickles are small plain references (dicts of strings)."""
    import s3fs

    secret = f"planted-secret-{uuid.uuid4().hex}"
    key_id = f"AKIAPLANTED{uuid.uuid4().hex[:8].upper()}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    s3fs.S3FileSystem.clear_instance_cache()
    options = {"key": key_id, "secret": secret, "client_kwargs": {"endpoint_url": s3_server}}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("secret-landing")
    fs.put(LandingResource().preferences, "secret-landing/preferences", recursive=True)
    fs.mkdir("secret-artifacts")
    landing = LandingResource(preferences="s3://secret-landing/preferences", storage_options=options)
    storage = StorageResource(root="s3://secret-artifacts/batchrl", storage_options=options,
                              cache_dir=str(tmp_path / "cache"))
    pickles = tmp_path / "io"
    resources = local_resources(str(tmp_path / "local"), landing, storage=storage,
                                io_manager=dg.FilesystemIOManager(base_dir=str(pickles)))
    log_file = tmp_path / "python.log"
    import logging

    handler = logging.FileHandler(log_file)
    logging.getLogger().addHandler(handler)
    try:
        (tmp_path / "dagster_home").mkdir()
        with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
            result = run_assets(resources, instance, selection=DATA)
            assert result.success
            events = [e for run in instance.get_runs() for e in instance.all_logs(run.run_id)]  # a run per drop
            assert len(events) > 20
            dumped = "\n".join(dg.serialize_value(e) for e in events)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert secret not in dumped and key_id not in dumped
    needles = [secret.encode(), key_id.encode()]
    assert _files_holding(tmp_path, needles) == []  # dagster home (runs, events, logs), cache, catalog, io
    catalog_rows = CatalogResource(path=str(tmp_path / "local" / "catalog.duckdb")).query("SELECT * FROM artifacts")
    assert len(catalog_rows) == 6 and secret not in str(catalog_rows) and key_id not in str(catalog_rows)
    for path in fs.find("secret-artifacts"):
        data = fs.cat(path)
        assert secret.encode() not in data and key_id.encode() not in data, path
    outputs = [p for p in pickles.rglob("*") if p.is_file()]
    assert len(outputs) == 6  # three assets per log drop
    for path in outputs:
        assert path.stat().st_size < 1024
        assert set(_plain_unpickle(path.read_bytes())) == {"asset", "uri", "data_version"}


class _OnlyPlain(pickle.Unpickler):
    def find_class(self, module, name):  # plain containers and strings need no class at all
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def _plain_unpickle(data: bytes):
    import io

    return _OnlyPlain(io.BytesIO(data)).load()


# -- code audit -----------------------------------------------------------------------------------------------
UNSAFE = [
    (re.compile(r"\bpickle\.loads?\("), "pickle"), (re.compile(r"\b(cloudpickle|dill|joblib)\.load"), "pickle"),
    (re.compile(r"read_pickle\("), "pickle"), (re.compile(r"\bmarshal\.loads?\("), "marshal"),
    (re.compile(r"\byaml\.load\((?![^)]*SafeLoader)"), "yaml.load"),
    (re.compile(r"allow_pickle\s*=\s*True"), "np.load(allow_pickle)"),
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"(?<![\w.])(eval|exec)\("), "eval/exec"),
]
#: reviewed exceptions: files the trainer itself wrote into its own work folder (not data, not uploads)
ALLOWED = {
    ("training/trainer/checkpoint.py", "torch.load without weights_only=True"):
        "RNG states of our own checkpoints (numpy/python RNG tuples need full unpickling)",
    ("training/trainer/policy.py", "torch.load without weights_only=True"):
        "fixed log-prob cache the trainer wrote in its work dir",
    ("training/rewards/code_tests.py", "eval/exec"):
        "the code reward's harness text: it execs the response inside the sandboxed child (training/sandbox.py)",
    ("training/sandbox/inside.py", "eval/exec"):
        "the sandboxed interpreter's own first module: runs the model's code after hardening itself (never imported)",
}


def test_no_unsafe_deserialisation_in_the_package():
    """Grep the package (not tests/bench): no pickle, marshal, unsafe YAML, eval/exec, and torch.load only
    with weights_only=True, except the reviewed ALLOWED sites. Models load from safetensors."""
    found = {}
    for dirpath, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in {".venv", "tests", "bench", ".git", "__pycache__", ".storage"}
                   and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), REPO)
                text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                for pattern, what in UNSAFE:
                    if pattern.search(text):
                        found[(rel, what)] = [line.strip() for line in text.splitlines() if pattern.search(line)]
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED}
    assert unexpected == {}
    assert set(ALLOWED) <= set(found)  # an exception no longer needed must be removed from the list


def test_redact_replaces_secret_values_and_keeps_the_rest():
    from batchrl.lineage.redact import REDACTED, redact

    metadata = {"storage_options": {"key": "AKIA1", "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://x",
                "aws_session_token": "tok"}}, "tokens_per_s": 12.5, "max_new_tokens": 64, "password": "",
                "table": dg.MetadataValue.md("| a |"), "runs": [{"api_key": "k"}, ("x", {"token": "t"})]}
    out = redact(metadata)
    assert out["storage_options"] == {"key": REDACTED, "secret": REDACTED,
                                      "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": REDACTED}}
    assert (out["tokens_per_s"], out["max_new_tokens"], out["password"]) == (12.5, 64, "")
    assert out["table"] is metadata["table"] and out["runs"] == [{"api_key": REDACTED}, ("x", {"token": REDACTED})]
    assert metadata["storage_options"]["secret"] == "s3cr3t"  # a copy: the caller's dict is untouched
