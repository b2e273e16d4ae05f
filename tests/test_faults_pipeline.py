"""Faults through the real stack: bad files in a Dagster run, concurrent publishes and catalog writers,
and SIGKILL in the middle of the data stages (the rerun completes; no partial artifact is visible)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import dagster as dg
import pytest
from bad_inputs import big_gzip_truncated, good, jl
from pipeline_helpers import latest_metadata, local_resources, run_assets
from process_workers import in_processes, publish_same, record_many

from batchrl.resources import CatalogResource, LandingResource

DATA = ["raw_logs", "cleaned_logs", "validated_preferences"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _landing_with_bad_file(tmp_path) -> LandingResource:
    prefs = tmp_path / "landing" / "preferences"
    shutil.copytree(LandingResource().preferences, prefs)
    (prefs / "zz_cut.jsonl.gz").write_bytes(big_gzip_truncated())
    return LandingResource(preferences=str(prefs))


def _versions(root, asset: str) -> list[str]:
    folder = os.path.join(root, asset)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_bad_file_policy_in_a_dagster_run(tmp_path):
    landing = _landing_with_bad_file(tmp_path)
    root = str(tmp_path / "s")
    resources = local_resources(root, landing)
    with dg.DagsterInstance.ephemeral() as instance:
        failed = run_assets(resources, instance, selection=DATA)  # default on_bad_file: fail
        assert not failed.success
        errors = " ".join(e.event_specific_data.error.to_string() for e in failed.get_step_failure_events())
        assert "zz_cut.jsonl.gz" in errors and "compressed stream ends early" in errors
        # the bad file is its own log drop: the two good drops are ingested, nothing of the bad one
        assert len(_versions(root, "cleaned_logs")) == 2 and len(_versions(root, "validated_preferences")) == 2
        assert CatalogResource(path=os.path.join(root, "catalog.duckdb")).query(
            "SELECT count(*) FROM artifacts WHERE asset != 'raw_logs'") == [(4,)]
        skip = {"config": {"on_bad_file": "skip"}}
        skipped = run_assets(resources, instance, selection=DATA, run_config={"ops": {"log_drop": skip}})
        cleaned = latest_metadata(instance, "cleaned_logs")  # the bad drop only: the good ones are done
        assert cleaned["reasons"] == {"bad_file": 1} and cleaned["rows_in"] == 1
        assert [b["path"] for b in cleaned["extra"]["bad_files"]] == ["zz_cut.jsonl.gz"]  # relative to the landing
        checks = {e.event_specific_data.check_name: e.event_specific_data.passed
                  for e in skipped.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
        # recorded, nothing lost, but a drop that is all bad file stops at its reject-rate gate
        assert checks == {"nothing_lost": True, "reject_rate_below_threshold": False} and not skipped.success


def test_concurrent_publishes_of_the_same_content(tmp_path):
    """Several processes publish the same content at once: one folder wins, every call succeeds, no
    temporary folder stays behind."""
    root = str(tmp_path / "root")
    stagings = []
    for i in range(6):
        staging = tmp_path / f"staging{i}"
        staging.mkdir()
        (staging / "data.bin").write_bytes(b"x" * (4 << 20))  # the same content in each
        stagings.append((root, str(staging)))
    uris = in_processes(publish_same, stagings)
    assert len(set(uris)) == 1 and os.listdir(os.path.join(root, "asset")) == [os.path.basename(uris[0])]
    assert open(os.path.join(uris[0], "data.bin"), "rb").read() == b"x" * (4 << 20)


def test_concurrent_writers_do_not_corrupt_the_catalog(tmp_path):
    """Four processes (as four concurrent runs) write the DuckDB catalog at once; DuckDB lets one process
    write at a time, the resource retries: every row arrives, the file stays readable."""
    path = str(tmp_path / "catalog.duckdb")
    assert in_processes(record_many, [(path, w, 15) for w in range(4)]) == [15] * 4
    catalog = CatalogResource(path=path)
    rows = catalog.query("SELECT asset, count(*), count(DISTINCT data_version) FROM artifacts GROUP BY asset "
                         "ORDER BY asset")
    assert rows == [(f"w{w}", 15, 15) for w in range(4)]
    metadata = catalog.query("SELECT metadata FROM artifacts WHERE asset = 'w3' ORDER BY data_version")
    assert [json.loads(m)["i"] for (m,) in metadata] == list(range(15))


RUNNER = """
import sys
import dagster as dg
from pipeline_helpers import local_resources, run_assets
from batchrl.resources import LandingResource
small = {"config": {"block_bytes": 65536, "row_group_rows": 4096, "batch_rows": 4096, "threads": 1}}
with dg.DagsterInstance.ephemeral() as instance:
    result = run_assets(local_resources(sys.argv[1], LandingResource(preferences=sys.argv[2])), instance,
                        selection=sys.argv[3].split(","),
                        run_config={"ops": {"log_drop": small}})
print("SUCCESS" if result.success else "FAILED")
"""


def _big_landing(folder) -> str:
    os.makedirs(folder, exist_ok=True)
    rows = [{"prompt": f"question {i}: " + "lorem ipsum " * 20, "chosen": f"answer {i}", "rejected": f"wrong {i}"}
            for i in range(40_000)]
    with open(os.path.join(folder, "big.jsonl"), "wb") as f:
        f.write(jl(*rows))
    return str(folder)


def _file_size_limit(limit: int):
    """preexec: files may not grow past ``limit`` bytes (EFBIG on write, as a full disk gives ENOSPC)."""
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with an error instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _run(root: str, landing: str, selection: str, kill_when=None, max_file_bytes: int | None = None) -> str | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE] + sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, root, landing, selection], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_file_size_limit(max_file_bytes) if max_file_bytes else None)
    if max_file_bytes:
        out, err = proc.communicate(timeout=300)
        return out + err
    if kill_when is None:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "SUCCESS" in out, err[-3000:]
        return None
    deadline = time.time() + 120
    while not kill_when():
        assert proc.poll() is None, f"finished before the kill point: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, "kill point never reached"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return "killed"


def _staged(root: str, asset: str) -> bool:
    """A stage is under way: its staging folder holds a Parquet file being written."""
    staging = os.path.join(root, "_cache", "_staging")
    if not os.path.isdir(staging):
        return False
    for name in os.listdir(staging):
        if name.startswith(f"{asset}-"):
            for _, _, files in os.walk(os.path.join(staging, name)):
                if any(".parquet.tmp-" in f for f in files):
                    return True
    return False


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted run over a 40k-row landing (the runs below compare with it)."""
    landing = _big_landing(tmp_path_factory.mktemp("landing"))
    reference = str(tmp_path_factory.mktemp("reference"))
    _run(reference, landing, ",".join(DATA))
    return landing, reference


def test_sigkill_mid_stage_then_rerun(tmp_path, reference_run):
    """SIGKILL while the one-pass data step writes (~10 s, subprocesses): no version of cleaned_logs or
    validated_preferences is visible (storage folder, catalog), the rerun completes and publishes exactly
    what an uninterrupted run does."""
    landing, reference = reference_run
    root = str(tmp_path / "root")
    assert _run(root, landing, ",".join(DATA), kill_when=lambda: _staged(root, "validated_preferences")) == "killed"
    for stage in ("cleaned_logs", "validated_preferences"):  # nothing half-published
        assert _versions(root, stage) == []
        assert CatalogResource(path=os.path.join(root, "catalog.duckdb")).query(
            "SELECT count(*) FROM artifacts WHERE asset = ?", [stage]) == [(0,)]
    _run(root, landing, ",".join(DATA))
    for asset in DATA:
        assert _versions(root, asset) == _versions(reference, asset), asset


def test_disk_full_mid_stage_publishes_nothing_and_rerun_completes(tmp_path, reference_run):
    """Every file write past 1 MB fails (RLIMIT_FSIZE: the same OSError path as a full disk) while
    the data step writes its ~10 MB Parquet: the run fails naming the write error, no version is published
    and no staging file stays behind; the rerun with room completes with the reference's versions."""
    landing, reference = reference_run
    root = str(tmp_path / "root")
    output = _run(root, landing, ",".join(DATA), max_file_bytes=1 << 20)
    assert "FAILED" in output and "File too large" in output
    assert _versions(root, "cleaned_logs") == [] and _versions(root, "validated_preferences") == []
    assert not [f for _, _, fs in os.walk(os.path.join(root, "_cache", "_staging")) for f in fs]
    _run(root, landing, ",".join(DATA))
    for asset in DATA:
        assert _versions(root, asset) == _versions(reference, asset), asset
