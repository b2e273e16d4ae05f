"""Where `batchrl run`'s time goes outside the asset steps: its start-up, the per-drop runs, the hand-over
to the concurrent run's step processes — the orchestration overhead of bench_gpu_pipeline, without a GPU.

    .venv/bin/python bench/bench_run_startup.py [--repeat 3] [--concurrent-steps 3] [--existing-home]
        [--warm-server] [--out F.json]

Each repeat runs the data assets (no models) through `batchrl run` into a fresh Dagster home and storage,
then reads the instance: per run (each log drop's, then the main one) when it was created, when its first
step started and its last step ended, in seconds from the command's start; and when the step server was
ready (its line in the run's log). Medians over the repeats are printed with every repeat's numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "scored_logs",
             "scored_pairs"]
# the CLI through this interpreter (a host without the console script, e.g. the device's carried environment)
BATCHRL = [sys.executable, "-c", "import sys; from batchrl.cli.main import console_main; console_main(sys.argv[1:])"]


def create_instance_tables(env: dict) -> None:
    """The Dagster home of ``env`` with its tables (and batchrl's dagster.yaml), as on a machine that ran batchrl
    before: what a run's start-up then no longer pays."""
    subprocess.run([sys.executable, "-c", "import dagster as dg; from batchrl.cli.instance import ensure_dagster_home; "
                    "ensure_dagster_home(); dg.DagsterInstance.get().dispose()"], env=env, check=True)


def one_run(root: str, steps: int, existing_home: bool = False, warm_server: bool = False) -> dict:
    home = os.path.join(root, "home")
    os.makedirs(home)
    env = {**os.environ, "DAGSTER_HOME": home, "BATCHRL_STORAGE": os.path.join(root, "storage")}
    if existing_home:
        create_instance_tables(env)
    if warm_server:  # up before the timer starts, as a server a user keeps (`batchrl serve`)
        subprocess.run([*BATCHRL, "serve", "--detach"], env=env, check=True, capture_output=True)
    started = time.time()
    try:
        subprocess.run([*BATCHRL, "run", "--select", ",".join(SELECTION), "--concurrent-steps", str(steps)],
                       env=env, check=True, capture_output=True)
        total = time.time() - started
    finally:
        if warm_server:
            subprocess.run([*BATCHRL, "serve", "--stop"], env=env, check=False, capture_output=True)
    out = {"total_s": round(total, 2), "runs": []}
    os.environ["DAGSTER_HOME"] = home
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        records = sorted(instance.get_run_records(), key=lambda r: r.create_timestamp.timestamp())
        for record in records:
            events = [(e.timestamp, e.dagster_event.event_type_value) for e in instance.all_logs(record.dagster_run.run_id)
                      if e.dagster_event]
            out["runs"].append({
                "run": record.dagster_run.tags.get("dagster/partition", "main"),
                "created_s": round(record.create_timestamp.timestamp() - started, 2),
                "first_step_s": round(min(t for t, k in events if k == "STEP_START") - started, 2),
                "last_step_end_s": round(max(t for t, k in events if k == "STEP_SUCCESS") - started, 2)})
    logs = "".join(open(os.path.join(home, "logs", f), errors="replace").read()
                   for f in os.listdir(os.path.join(home, "logs")) if f.startswith("run-"))  # not a server's
    ready = re.search(r"step server: preloaded in [\d.]+ s, ready [\d.]+ s after start \(at ([\d.]+)\)", logs)
    out["step_server_ready_s"] = round(float(ready[1]) - started, 2) if ready else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrent-steps", type=int, default=3)
    parser.add_argument("--out", help="write the report (JSON) here too")
    parser.add_argument("--existing-home", action="store_true",
                        help="the Dagster home's tables exist before the timer starts (default: the run creates them)")
    parser.add_argument("--warm-server", action="store_true",
                        help="`batchrl serve` is up before the timer starts: the command runs in a fork of it")
    a = parser.parse_args()
    repeats = []
    for _ in range(a.repeat):
        root = tempfile.mkdtemp(prefix="bench-startup-")
        try:
            repeats.append(one_run(root, a.concurrent_steps, a.existing_home, a.warm_server))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def median(pick) -> float | None:
        values = [v for v in map(pick, repeats) if v is not None]
        return round(statistics.median(values), 2) if values else None

    summary = {"first_step_s": median(lambda r: r["runs"][0]["first_step_s"]),
               "main_run_created_s": median(lambda r: r["runs"][-1]["created_s"]),
               "main_first_step_s": median(lambda r: r["runs"][-1]["first_step_s"]),
               "step_server_ready_s": median(lambda r: r["step_server_ready_s"]),
               "total_s": median(lambda r: r["total_s"])}
    report = {"concurrent_steps": a.concurrent_steps, "warm_server": a.warm_server, "median": summary, "repeats": repeats}
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
