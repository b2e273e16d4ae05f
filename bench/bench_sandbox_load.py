"""Sandbox seconds per trajectory at N concurrent trajectories: replay (a fresh sandbox per call, earlier cells run
again) against the persistent interpreter (one per trajectory, kept between its calls).

The tool task's calls as the agent loop makes them: every turn, each of ``--trajectories`` trajectories runs its next
cell at the same time (``tool_workers`` threads), ``--calls`` cells a trajectory (x = EXPR; y = x * 1; print(y)),
``--batches`` batches. "Sandbox seconds per trajectory" = the sum of the trajectory's calls' own wall time plus, for
the persistent interpreter, its start (made with the trajectory: its boot overlaps the first turn's generation;
``--generate-s`` sleeps that long before each turn, as the GPU would generate) and its teardown. Both arms at the
level given (default: the strongest here), in one process, alternating batches so both see the same background load.

    PYTHONPATH=<parent of a 'batchrl' link> .venv/bin/python bench/bench_sandbox_load.py --out bench/results/x.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from batchrl.training import sandbox
from batchrl.training.agent.tools import SESSIONS

CELLS = ["x = {a} * {b} + {c}\n", "y = x * 1\n", "print(y)\n"]


def _cells(index: int, calls: int) -> list[str]:
    a, b, c = 1000 + index, 937 + index, 42 * index
    return [CELLS[i % len(CELLS)].format(a=a, b=b, c=c) for i in range(calls)]


def one_batch(kind: str, level: str, limits: sandbox.SandboxLimits, trajectories: int, calls: int,
              generate_s: float) -> dict:
    """One batch of ``trajectories`` run turn by turn; per trajectory its sandbox seconds."""
    spent = [0.0] * trajectories
    sessions = []
    for i in range(trajectories):  # the persistent interpreter starts here (its boot overlaps what follows)
        t = time.perf_counter()
        sessions.append(SESSIONS[kind](limits, level))
        spent[i] += time.perf_counter() - t
    outputs = [[] for _ in range(trajectories)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=trajectories) as pool:
        for turn in range(calls):
            time.sleep(generate_s)
            cells = [_cells(i, calls)[turn] for i in range(trajectories)]
            for i, result in enumerate(pool.map(lambda pair: pair[0].run(pair[1]), zip(sessions, cells))):
                spent[i] += result.wall_s
                outputs[i].append((result.output, result.status))

        def close(i: int) -> None:
            t = time.perf_counter()
            sessions[i].close()
            spent[i] += time.perf_counter() - t
        list(pool.map(close, range(trajectories)))
    return {"wall_s": time.perf_counter() - started, "per_trajectory_s": spent, "outputs": outputs}


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return {"cpus": os.cpu_count(), "cpu": model, "kernel": platform.release(), "load_avg_start": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--generate-s", type=float, default=0.0, help="seconds the model's turn takes (slept)")
    parser.add_argument("--level", default=None, help="a sandbox level (default: the strongest here)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    host = machine()  # the load average before the bench: the dev box is shared
    level = args.level or sandbox.isolation_level()
    limits = sandbox.SandboxLimits(timeout_s=30.0, memory_mb=512, max_output_bytes=16384, cpu_s=90.0)
    runs: dict[str, list[dict]] = {"replay": [], "persistent": []}
    for _ in range(args.batches):
        for kind in runs:
            runs[kind].append(one_batch(kind, level, limits, args.trajectories, args.calls, args.generate_s))
    same = runs["replay"][0]["outputs"] == runs["persistent"][0]["outputs"]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": host, "level": level,
              "sandbox": sandbox.describe(level, limits), "trajectories": args.trajectories, "calls": args.calls,
              "batches": args.batches, "generate_s": args.generate_s, "same_observations": same,
              "load_avg_end": os.getloadavg()}
    for kind, batches in runs.items():
        per = [s for batch in batches for s in batch["per_trajectory_s"]]
        report[kind] = {"sandbox_s_per_trajectory_mean": statistics.mean(per),
                        "sandbox_s_per_trajectory_median": statistics.median(per),
                        "sandbox_s_per_call_mean": statistics.mean(per) / args.calls,
                        "batch_wall_s_median": statistics.median(b["wall_s"] for b in batches)}
    report["speedup_sandbox_s"] = (report["replay"]["sandbox_s_per_trajectory_mean"]
                                   / report["persistent"]["sandbox_s_per_trajectory_mean"])
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
