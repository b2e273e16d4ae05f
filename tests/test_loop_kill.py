"""The RL loop as a user runs it (`batchrl run --rl-iterations N`, each iteration in the run's own process) killed
with SIGKILL while iteration 2 trains: every checkpoint published before is whole (its files hash to its data
version) and still promoted; a rerun starts from it and completes the chain, each promoted checkpoint the parent of
the next (issue 32). Then a time-boxed run of many iterations: the budget, spent by its first iteration, is said
once and ends the loop."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import dagster as dg
from helpers_batchrl_run import BATCHRL
from pipeline_helpers import TINY_BASE

from batchrl.common import fsutil

RL_LOOP = "rollouts,rewards,advantages,policy_checkpoint"
SMALL = {"ops": {  # no reward model: the rule reward alone (at weight 0 the model is not an input that loads)
    "base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
    "rollouts": {"config": {"max_prompts": 8}},
    "rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.0}}},
}, "resources": {"rl_recipe": {"samples_per_prompt": 2}}}  # a -c file's resources: the RL recipe's fields


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "BATCHRL_STORAGE": str(tmp_path / "storage"),
            "BATCHRL_SERVER": "off"}  # the run in the process started here: that is the process killed


def _promoted_chain(env: dict[str, str]) -> list[dict]:
    """promoted_policy's materialisations, oldest first: the checkpoint's data version, uri and parent."""
    os.environ["DAGSTER_HOME"], saved = env["DAGSTER_HOME"], os.environ.get("DAGSTER_HOME")
    try:
        with dg.DagsterInstance.get() as instance:
            records = instance.fetch_materializations(dg.AssetKey("promoted_policy"), limit=100).records
            return [{key: getattr(r.asset_materialization.metadata[key], "value", None)
                     for key in ("data_version", "uri", "parent")} for r in reversed(records)]
    finally:
        os.environ.pop("DAGSTER_HOME") if saved is None else os.environ.__setitem__("DAGSTER_HOME", saved)


def _assert_whole(uri: str, scratch: str) -> None:
    """The published folder's model files (not the records beside them) hash to its data version (a half-written
    one would not)."""
    version = os.path.basename(uri)
    data = [n for n in os.listdir(uri) if n not in fsutil.RECORD_FILES]
    copy = os.path.join(scratch, version)
    os.makedirs(copy)
    for name in data:
        src = os.path.join(uri, name)
        (os.link if os.path.isfile(src) else os.symlink)(src, os.path.join(copy, name))
    assert fsutil.sha256_tree(fsutil.filesystem_for(copy)[0], copy)[:16] == version, uri


def test_sigkill_mid_iteration_keeps_every_published_checkpoint_and_the_rerun_completes_the_chain(tmp_path,
                                                                                                  upstream_copy):
    env = _env(tmp_path)
    assert SMALL["ops"]["base_model"] == TINY_BASE["ops"]["base_model"]  # the copied upstream's base model
    upstream_copy(tmp_path)  # the upstream assets in tmp_path/storage and tmp_path/home, where _env points
    config = tmp_path / "small.yaml"
    config.write_text(json.dumps(SMALL))  # YAML reads JSON

    log = tmp_path / "loop.log"
    with open(log, "w") as out:
        loop = subprocess.Popen([BATCHRL, "run", "--select", RL_LOOP, "--rl-iterations", "3", "-c", str(config),
                                 "--verbose"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: the job worker dies with it
    try:
        deadline = time.monotonic() + 600
        # killed once iteration 2 has started training: iteration 1's checkpoint is published and promoted
        while "RL iteration 2 of 3" not in log.read_text() or \
                log.read_text().split("RL iteration 2 of 3", 1)[1].count('Started execution of step '
                                                                         '"policy_checkpoint"') < 1:
            assert loop.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(loop.pid, signal.SIGKILL)
    finally:
        loop.wait(timeout=60)
    assert loop.returncode == -signal.SIGKILL

    before = _promoted_chain(env)
    assert len(before) == 1, before  # iteration 2 was killed before it could publish
    scratch = str(tmp_path / "hashcheck")
    _assert_whole(before[0]["uri"], scratch)

    rerun = subprocess.run([BATCHRL, "run", "--select", RL_LOOP, "--rl-iterations", "2", "-c", str(config)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    chain = _promoted_chain(env)
    assert chain[0] == before[0] and len(chain) == 3, chain
    for parent, child in zip(chain, chain[1:]):  # the rerun went on from the checkpoint the kill left promoted
        assert child["parent"] == f"policy_checkpoint@{parent['data_version']}", chain
        _assert_whole(child["uri"], scratch)
    assert chain[0]["parent"].startswith("base_model@")

    # --max-minutes: the first execution always runs; every RL iteration after the budget is skipped, said once
    boxed = subprocess.run([BATCHRL, "run", "--select", RL_LOOP, "--rl-iterations", "300", "--max-minutes", "0.0001",
                            "-c", str(config)], env=env, capture_output=True, text=True, timeout=600)
    assert boxed.returncode == 0, boxed.stdout[-3000:] + boxed.stderr[-3000:]
    assert boxed.stdout.count("time budget of 0.0001 min reached") == 1, boxed.stdout[-3000:]
    assert "=== RL iteration" not in boxed.stdout, boxed.stdout[-3000:]
    assert len(_promoted_chain(env)) == len(chain) + 1

    # too little room for what an iteration publishes: the loop stops at the next iteration's boundary (after the
    # first execution's), says why, and exits 1 (every published checkpoint stays)
    cramped = subprocess.run([BATCHRL, "run", "--select", RL_LOOP, "--rl-iterations", "3", "-c", str(config)],
                             env={**env, "BATCHRL_MIN_FREE_GB": "1000000"}, capture_output=True, text=True, timeout=600)
    assert cramped.returncode == 1, cramped.stdout[-3000:] + cramped.stderr[-3000:]
    assert cramped.stdout.count("=== disk: ") == 1 and "no further RL iteration" in cramped.stdout, cramped.stdout
    assert "=== RL iteration" not in cramped.stdout and "stopped before all RL iterations" in cramped.stderr
    assert len(_promoted_chain(env)) == len(chain) + 2
