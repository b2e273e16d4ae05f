"""SIGKILL during the RL and DPO stages (rollouts, rewards, advantages, reference log-probs): the killed
stage leaves no version, every visible version is complete, the rerun completes. (The trainings' kill +
resume is tested in test_trainer_jobs.py; cleaning and validation in test_faults_pipeline.py.)

One test, ~1.5 min on the loaded 2-core box (four killed subprocesses and the reward-model trainer's;
35 s before the reward model trained through DeepSpeed): the upstream assets are materialised once in this process; then each stage runs alone
in a subprocess (its inputs load through ArtifactIOManager from the instance's materialisations), is killed as soon as Dagster starts its step, and runs again to completion here."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import dagster as dg
from pipeline_helpers import TINY_BASE, local_resources, run_assets
from pipeline_helpers import UPSTREAM as PIPELINE_UPSTREAM

from batchrl.common import fsutil
from batchrl.resources import CatalogResource
from batchrl.resources.storage import LINEAGE_FILE

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = {"ops": {
    "base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
    "rollouts": {"config": {"max_prompts": 16}},
    "reward_model": {"config": {"epochs": 1, "max_pairs": 32, "max_length": 64}},
}, "resources": {"rl_recipe": {"config": {"samples_per_prompt": 2}}}}
UPSTREAM = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
            "prompts", "base_model", "reward_model"]
STAGES = [("rollouts", True), ("rewards", True), ("advantages", True), ("dpo_pairs", False),
          ("reference_logprobs", True)]  # (stage, killed before its complete run)

RUNNER = """
import sys
import dagster as dg
from pipeline_helpers import local_resources, run_assets
from tests_config import SMALL
root, home, stage = sys.argv[1:4]
resources = local_resources(root)
with dg.DagsterInstance.local_temp(home) as instance:
    result = run_assets(resources, instance, selection=[stage], run_config=SMALL)
print("SUCCESS" if result.success else "FAILED", flush=True)
"""


def _killed_run(root: str, home: str, stage: str) -> str:
    """Run ``stage`` alone in a subprocess and SIGKILL it as soon as Dagster starts its step."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE] + sys.path)}
    script = RUNNER.replace("from tests_config import SMALL", f"SMALL = {SMALL!r}")
    proc = subprocess.Popen([sys.executable, "-c", script, root, home, stage], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    started = threading.Event()
    tail: list[str] = []

    def watch() -> None:  # Dagster's console log goes to stderr
        for line in proc.stderr:
            tail[:] = (tail + [line])[-40:]
            if f'Started execution of step "{stage}"' in line:
                started.set()
                proc.send_signal(signal.SIGKILL)

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    out = proc.stdout.read()
    proc.wait(timeout=600)
    reader.join(timeout=10)
    assert started.is_set() and proc.returncode == -signal.SIGKILL, out + "".join(tail)
    return "killed"


def _complete_versions(root: str, asset: str, scratch: str) -> list[str]:
    """Version folders of ``asset``; each must be whole: lineage.json present and the data files hash to
    the folder name (a half-copied folder would not)."""
    folder = os.path.join(root, asset)
    versions = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    fs = fsutil.filesystem_for(root)[0]
    for version in versions:
        path = os.path.join(folder, version)
        assert ".tmp-" not in version and os.path.exists(os.path.join(path, LINEAGE_FILE)), version
        data = [n for n in os.listdir(path) if n != LINEAGE_FILE]
        tmp = os.path.join(scratch, asset, version)
        os.makedirs(tmp, exist_ok=True)
        for name in data:
            os.link(os.path.join(path, name), os.path.join(tmp, name))
        assert fsutil.sha256_tree(fs, tmp)[:16] == version
        for name in data:
            os.remove(os.path.join(tmp, name))
    return versions


def test_sigkill_in_rl_and_dpo_stages_then_rerun(tmp_path, upstream_copy):
    assert SMALL["ops"]["base_model"] == TINY_BASE["ops"]["base_model"]  # the copied upstream's base model
    root, home = upstream_copy(tmp_path)  # the session's data stages and base model; the scored path trained here
    resources = local_resources(root)  # inputs load through ArtifactIOManager: the instance names the versions
    with dg.DagsterInstance.local_temp(home) as instance:
        scored = [a for a in UPSTREAM if a not in PIPELINE_UPSTREAM]
        assert run_assets(resources, instance, selection=scored, run_config=SMALL).success
    catalog = CatalogResource(path=os.path.join(root, "catalog.duckdb"))
    scratch = str(tmp_path / "hashcheck")
    for stage, kill in STAGES:
        if kill:
            assert _killed_run(root, home, stage) == "killed"
            # killed as its step started: nothing half-done is visible (a version, if the stage had
            # already finished publishing, would have to be complete: _complete_versions checks it)
            assert len(_complete_versions(root, stage, scratch)) <= 1, stage
        with dg.DagsterInstance.local_temp(home) as instance:  # the rerun (in this process: no imports)
            assert run_assets(resources, instance, selection=[stage], run_config=SMALL).success, stage
        assert len(_complete_versions(root, stage, scratch)) == 1, stage
        assert catalog.query("SELECT count(*) FROM artifacts WHERE asset = ?", [stage]) == [(1,)]
