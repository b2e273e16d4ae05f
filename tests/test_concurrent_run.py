"""`batchrl run --concurrent-steps N`: independent steps run at once, each in a process of its own (Dagster's
multiprocess executor, as from the UI), with the same results as one step at a time."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import dagster as dg
import pytest

SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "scored_logs",
             "scored_pairs"]
BATCHRL = os.path.join(os.path.dirname(sys.executable), "batchrl")


def _run(tmp_path, name: str, steps: int, served: bool = False) -> dict:
    """One `batchrl run` of SELECTION into its own instance (``served``: in a fork of `batchrl serve`, started
    for it): per step of the run after the per-drop ones, its start and end times and the pid of the process that
    executed it; the (asset, data version) it printed."""
    home, storage = tmp_path / name / "home", tmp_path / name / "storage"
    home.mkdir(parents=True)
    env = {**os.environ, "DAGSTER_HOME": str(home), "BATCHRL_STORAGE": str(storage)}
    if served:
        up = subprocess.run([BATCHRL, "serve", "--detach", "--idle", "120"], env=env, timeout=300)
        assert up.returncode == 0, (home / "logs" / "server.log").read_text(errors="replace")[-3000:]
    try:
        done = subprocess.run([BATCHRL, "run", "--select", ",".join(SELECTION), "--concurrent-steps", str(steps)],
                              env=env, capture_output=True, text=True, timeout=300)
    finally:
        if served:
            subprocess.run([BATCHRL, "serve", "--stop"], env=env, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    os.environ["DAGSTER_HOME"], saved = str(home), os.environ.get("DAGSTER_HOME")
    try:
        with dg.DagsterInstance.get() as instance:
            steps_seen: dict[str, dict] = {}
            for run in instance.get_runs():
                for entry in instance.all_logs(run.run_id):
                    kind = entry.dagster_event.event_type_value if entry.dagster_event else None
                    if kind in ("STEP_START", "STEP_SUCCESS") and not run.tags.get("dagster/partition"):
                        step = steps_seen.setdefault(entry.step_key, {})
                        step["start" if kind == "STEP_START" else "end"] = entry.timestamp
                        step["pid"] = entry.dagster_event.pid
    finally:
        os.environ.pop("DAGSTER_HOME") if saved is None else os.environ.__setitem__("DAGSTER_HOME", saved)
    # the console's asset lines: "[ k/n] ok   <asset>   <seconds> s  <data version>  <headline numbers>"
    lines = [re.match(r"\[\s*\d+/\d+\] (\w+)\s+(\w+)\s+[\d.]+ s\s+(\w+)", line) for line in done.stdout.splitlines()]
    logs = "".join(path.read_text(errors="replace") for path in (home / "logs").glob("run-*.log"))
    server = home / "logs" / "server.log"
    return {"steps": steps_seen, "versions": sorted((m[2], m[3]) for m in lines if m and m[1] == "ok"),
            "console": done.stdout + done.stderr, "log": logs,
            "server_log": server.read_text(errors="replace") if server.exists() else ""}


def test_independent_steps_overlap_in_processes_of_their_own_with_the_same_results(tmp_path):
    one, three = _run(tmp_path, "sequential", 1), _run(tmp_path, "concurrent", 3)
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
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
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
