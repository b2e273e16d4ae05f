"""`batchrl run --concurrent-steps N`: independent steps run at once, each in a process of its own (Dagster's
multiprocess executor, as from the UI), with the same results as one step at a time."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers_batchrl_run import run_selection

from batchrl.common.environment_variables import EnvironmentVariableError


def test_independent_steps_overlap_in_processes_of_their_own_with_the_same_results(tmp_path):
    one, three = run_selection(tmp_path, "sequential", 1), run_selection(tmp_path, "concurrent", 3)
    windows = sorted((s["start"], s["end"]) for s in three["steps"].values())
    overlapping = sum(later[0] < earlier[1] for earlier, later in zip(windows, windows[1:]))
    assert overlapping >= 1, three["steps"]  # prompts, scored_logs and preference_window need nothing of each other
    assert len({s["pid"] for s in three["steps"].values()}) >= 3  # a process per step
    assert len({s["pid"] for s in one["steps"].values()}) == 1  # one at a time, in the run's process
    assert "DEBUG" not in three["console"]  # the step processes' own output goes to the run's log
    # ... with the step server's readiness (what a first step waits for when the run gets there sooner)
    assert re.search(r"step server: preloaded in [\d.]+ s, ready [\d.]+ s after start", three["log"])
    assert len(one["versions"]) == 10 and three["versions"] == one["versions"]  # 3 per-drop assets x 2 drops + 4


def test_the_gpu_environment_overlaps_steps_by_default(monkeypatch):
    """`batchrl run` overlaps independent steps in the GPU environment (their jobs share the GPU), not on CPU;
    BATCHRL_CONCURRENT_STEPS overrides either."""
    from batchrl.cli.run_command import default_concurrent_steps

    monkeypatch.delenv("BATCHRL_CONCURRENT_STEPS", raising=False)
    defaults = {}
    for env in ("local", "s3", "gpu"):
        monkeypatch.setenv("BATCHRL_ENV", env)
        defaults[env] = default_concurrent_steps()
    assert defaults == {"local": 1, "s3": 1, "gpu": 3}
    monkeypatch.setenv("BATCHRL_ENV", "elsewhere")
    assert default_concurrent_steps() == 1  # `batchrl audit` and the like still parse their arguments
    monkeypatch.setenv("BATCHRL_CONCURRENT_STEPS", "1")
    assert default_concurrent_steps() == 1
    monkeypatch.setenv("BATCHRL_CONCURRENT_STEPS", "0")
    with pytest.raises(EnvironmentVariableError, match="BATCHRL_CONCURRENT_STEPS='0': at least 1"):
        default_concurrent_steps()


@pytest.mark.parametrize("env,torch_preloaded", [("local", True), ("gpu", False)])
def test_the_step_server_preload_leaves_a_fresh_instance_to_the_run(tmp_path, env, torch_preloaded):
    """The preload runs while the run's own process creates a fresh instance's tables: if it opened the instance
    too, the two would create the same tables at once ("table jobs already exists"). It loads torch only where
    the steps run models in their own process (on the GPU host they are jobs, advantages too)."""
    home = tmp_path / "home"
    home.mkdir()
    preload = "import sys, batchrl.runs.step_preload; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", preload],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DAGSTER_HOME": str(home), "BATCHRL_ENV": env})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step server: preloaded" in done.stderr
    assert done.stdout.strip() == str(torch_preloaded)
    assert list(home.iterdir()) == []


def test_a_chain_of_steps_runs_in_process_whatever_the_concurrency():
    """An RL iteration (rollouts → rewards → advantages → policy_checkpoint) has no two steps that could run at
    once: `execute_assets` runs it in process even with --concurrent-steps > 1 (no step processes to start); a
    selection with independent steps still goes to the multiprocess executor."""
    from batchrl.cli.run_command import RL_LOOP
    from batchrl.definitions import build_definitions
    from batchrl.runs.execute import is_chain, selected_job

    defs = build_definitions()
    assert is_chain(selected_job(defs, list(RL_LOOP)))
    assert is_chain(selected_job(defs, ["rewards"]))
    assert not is_chain(selected_job(defs, ["prompts", "preference_window"]))
    assert not is_chain(selected_job(defs, None))
