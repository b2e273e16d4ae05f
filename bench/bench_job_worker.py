"""Per-job start-up cost: the same trainer job through Dagster Pipes as a fresh subprocess each time
vs in the long-lived job worker (launcher backend ``worker``), on this machine (CPU here; on a GPU the
fresh process also pays CUDA context and process-group start).

    .venv/bin/python bench/bench_job_worker.py [--repeats 3]
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import dagster as dg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from arith_pairs import build_arith_pairs  # noqa: E402  (the tests' small pairs + tiny model)

from batchrl.resources import TrainerLauncherResource  # noqa: E402


def time_jobs(launcher: TrainerLauncherResource, inputs: dict, root: str, repeats: int) -> list[float]:
    times, pids = [], []
    for i in range(repeats):
        out = os.path.join(root, f"ref{i}")
        os.makedirs(out)

        @dg.asset(name=f"reference_logprobs_{i}")
        def reference(context: dg.AssetExecutionContext, trainer: TrainerLauncherResource):
            return trainer.run_job(context, "reference_logprobs", {
                "model_path": inputs["model_path"], "pairs_parquet": inputs["pairs_parquet"],
                "out_parquet": os.path.join(out, "ref.parquet"), "max_length": 64}, out)

        started = time.perf_counter()
        result = dg.materialize([reference], resources={"trainer": launcher})
        times.append(time.perf_counter() - started)
        meta = result.asset_materializations_for_node(f"reference_logprobs_{i}")[-1].metadata
        if "worker_pid" in meta:
            pids.append(meta["worker_pid"].value)
    for pid in set(pids):
        os.kill(pid, signal.SIGTERM)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-worker-")
    from pathlib import Path

    inputs = build_arith_pairs(Path(root), rejected_offset=2)
    fresh = time_jobs(TrainerLauncherResource(), inputs, os.path.join(root, "fresh"), a.repeats)
    warm = time_jobs(TrainerLauncherResource(backend="worker", env={"BATCHRL_STORAGE": root}), inputs,
                     os.path.join(root, "warm"), a.repeats)
    print(json.dumps({"job": "reference_logprobs (32 pairs, tiny model)", "fresh_subprocess_s": fresh,
                      "worker_s": warm, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
