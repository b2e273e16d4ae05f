"""`batchrl run` of a data selection in a fresh instance, as a subprocess, shared by test_concurrent_run and
test_warm_server: what each step's process did and when, and what the run printed."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import dagster as dg

SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "scored_logs",
             "scored_pairs"]
BATCHRL = os.path.join(os.path.dirname(sys.executable), "batchrl")


def run_selection(tmp_path, name: str, steps: int, served: bool = False) -> dict:
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
