"""Where an RL iteration's seconds outside generation and the optimiser steps go (issue 32): cProfile of the Dagster
process running the RL chain, and of every job the job worker runs (``BATCHRL_CPROFILE_DIR``).

After the real profile's preparation (``bench_gpu_rl_vs_trl.PREP``, untimed) and one warm-up iteration (the job
worker started, the caches warm), ``--iterations`` RL iterations run in this process under cProfile
(``batchrl.cli.main.main``, the warm server off). Writes to ``--out``: ``plumbing.json`` (each step's wall per
iteration, the jobs' reported phases) and ``plumbing.txt`` (the top functions by cumulative and by own time, of the
Dagster process and of each job kind, summed over the iterations) and the profiles themselves (``dagster.prof``,
``<job>.prof``); ``timeline.txt``: every event of one more iteration, unprofiled, timed from its run's start.

    python3 bench/profile_rl_plumbing.py --iterations 4 --state /tmp/plumb --out $OUT   # on the device (gpu env)
    BENCH_SMOKE=1 python3 bench/profile_rl_plumbing.py --iterations 1 --state /tmp/plumb --out /tmp/plumb-out  # CPU
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
import pstats
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_rl_vs_trl import PREP, REPO, RL_CHAIN, _arm_env, _arm_history, _batchrl  # noqa: E402


def _top(stats: pstats.Stats, sort: str, limit: int) -> str:
    text = io.StringIO()
    stats.stream = text
    stats.sort_stats(sort).print_stats(limit)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


TIMELINE = r"""
import dagster as dg
with dg.DagsterInstance.get() as inst:
    run = inst.get_runs(limit=1)[0]
    events = inst.all_logs(run.run_id)
    t0 = events[0].timestamp
    for e in events:
        kind = e.dagster_event.event_type_value if e.is_dagster_event else "LOG"
        print(f"{e.timestamp - t0:8.3f} {kind:30s} {e.step_key or '':18s} {(e.user_message or '')[:110]!r}")
"""


def timeline(env: dict[str, str], log: str) -> str:
    """Every event of one more RL iteration, unprofiled, with its time from the run's start: where a step's wall
    goes between its job's messages."""
    code, _ = _batchrl(env, ["--select", RL_CHAIN, "--rl-iterations", "1"], log)
    if code:
        raise SystemExit(f"the timeline's iteration failed ({code}); see {log}")
    return subprocess.run([sys.executable, "-c", TIMELINE], env=env, capture_output=True, text=True, check=True).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--state", required=True, help="storage roots and Dagster homes")
    parser.add_argument("--out", required=True)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = _arm_env(args.state, "plumbing")
    worker_profiles = os.path.join(args.state, "worker_profiles")
    log = os.path.join(args.out, "plumbing_run.log")
    for selection, iterations in ((PREP, 1), (RL_CHAIN, 1)):  # untimed: the base, the prompts, a warm-up iteration
        code, _ = _batchrl(env, ["--select", selection, "--rl-iterations", str(iterations)], log)
        if code:
            raise SystemExit(f"{selection} failed ({code}); see {log}")
    warmed_runs = {(r["start"], r["end"]) for r in _arm_history(env)["runs"]}

    os.environ.update(env, BATCHRL_SERVER="off", BATCHRL_CPROFILE_DIR=worker_profiles)
    os.chdir(REPO)
    from batchrl.cli.main import main as batchrl_main

    profile = cProfile.Profile()
    profile.enable()
    code = batchrl_main(["run", "--profile", "real", "--select", RL_CHAIN, "--rl-iterations", str(args.iterations)])
    profile.disable()
    os.environ.pop("BATCHRL_CPROFILE_DIR")

    history = _arm_history(env)
    runs = sorted((r for r in history["runs"] if (r["start"], r["end"]) not in warmed_runs), key=lambda r: r["start"])
    report = {"exit_code": code, "iterations": args.iterations,
              "runs": [{"wall_s": round(r["end"] - r["start"], 3), "steps": {k: round(v, 3) for k, v in r["steps"].items()}}
                       for r in runs],
              "jobs": {asset: [{k: v for k, v in m.items() if k.endswith("_s") or k.startswith("phase_s")}
                               for m in history["meta"][asset][-args.iterations:]]
                       for asset in ("rollouts", "policy_checkpoint")}}
    with open(os.path.join(args.out, "plumbing.json"), "w") as f:
        json.dump(report, f, indent=1)
    sections = [("the Dagster process", pstats.Stats(profile))]
    by_job: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(worker_profiles, "*.prof"))):
        by_job.setdefault(os.path.basename(path).split("-")[0], []).append(path)
    sections += [(f"job {job} ({len(paths)} runs)", pstats.Stats(*paths))
                 for job, paths in by_job.items()]
    profile.dump_stats(os.path.join(args.out, "dagster.prof"))
    for job, paths in by_job.items():  # pstats.Stats(file) reads them back, summed over the job's runs
        pstats.Stats(*paths).dump_stats(os.path.join(args.out, f"{job}.prof"))
    with open(os.path.join(args.out, "timeline.txt"), "w") as f:
        f.write(timeline(env, log))
    with open(os.path.join(args.out, "plumbing.txt"), "w") as f:
        for title, stats in sections:
            f.write(f"===== {title}: cumulative\n{_top(stats, 'cumulative', args.top)}\n\n")
            f.write(f"===== {title}: own time\n{_top(stats, 'tottime', args.top // 2)}\n\n")
    print(json.dumps(report, indent=1)[:6000])
    return code


if __name__ == "__main__":
    sys.exit(main())
