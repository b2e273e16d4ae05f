"""Data-parallel scaling of batchrl's DPO trainer job: the same global batch on 1 and N GPUs.

    python3 bench/bench_gpu_scaling.py --out DIR [--gpus 1,2] [--pairs 640] [--global-batch 16] [--seq 1024]
                                       [--zero-stage 2] [--tiny]

Each count runs the real ``train_dpo`` job as batchrl launches it (``job_command``: one process, or torchrun with
one rank per GPU and the launcher's environment: NVLink multicast off), one epoch over the same pairs and reference
log-probs (``bench_gpu_train.prepare``: Qwen2-0.5B shape, random weights, prompt + completion = ``--seq`` tokens),
``global_batch_size`` fixed so the update is the same whatever the count. Throughput is steady-state: tokens of the
steps between the job's first and last metrics line (arrival times read here), tokens per step = 2 x global batch x
seq. Scaling efficiency of N = tokens/s(N) / (N x tokens/s(1)); the issue's goal at 2 GPUs is >= 90%.
``--tiny``: a tiny model on CPU ranks with gloo (a smoke run of this script; its figures mean nothing).
Results: ``DIR/scaling.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def run_count(num_gpus: int, a, work: str, reference: str) -> dict:
    """One epoch of the DPO job on ``num_gpus`` ranks: steady tokens/s from its metrics lines' arrival times."""
    from batchrl.resources import TrainerLauncherResource
    from batchrl.training.jobs import job_command

    out_dir = os.path.join(work, f"dpo_{num_gpus}")
    shutil.rmtree(out_dir, ignore_errors=True)  # a leftover folder would make the job resume a finished run
    micro = a.global_batch // num_gpus
    config = {"trainer": {"epochs": 1, "micro_batch_size": micro, "global_batch_size": a.global_batch,
                          "max_length": a.seq, "zero_stage": a.zero_stage, "metrics_every": a.metrics_every,
                          "lr": 1e-6},
              "pairs_parquet": os.path.join(work, "pairs.parquet"), "model_path": os.path.join(work, "model"),
              "reference_parquet": reference, "out_dir": out_dir}
    path = os.path.join(work, f"dpo_{num_gpus}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    env = {k: v for k, v in TrainerLauncherResource(num_gpus=num_gpus).job_env().items()
           if not k.startswith("DAGSTER_PIPES")}  # stdout JSON lines, not Pipes
    started, reads, final = time.perf_counter(), [], None
    proc = subprocess.Popen(job_command("train_dpo", path, num_gpus=num_gpus), env=env, stdout=subprocess.PIPE,
                            stderr=open(os.path.join(work, f"dpo_{num_gpus}.log"), "w"), text=True)
    for line in proc.stdout:
        if line.startswith('{"step"'):
            reads.append((json.loads(line)["step"], time.perf_counter()))
        elif line.startswith('{"materialization"'):
            final = json.loads(line)["materialization"]
    rc = proc.wait()
    tokens_per_step = 2 * a.global_batch * a.seq
    result = {"gpus": num_gpus, "rc": rc, "micro_batch_size": micro, "job_wall_s": round(time.perf_counter() - started, 1),
              "metrics_reads": len(reads), "global_step": (final or {}).get("global_step")}
    if len(reads) >= 2 and reads[-1][0] > reads[0][0]:
        (s0, t0), (s1, t1) = reads[0], reads[-1]
        result.update(steady_steps=s1 - s0, step_s=round((t1 - t0) / (s1 - s0), 4),
                      tokens_per_s=round(tokens_per_step * (s1 - s0) / (t1 - t0), 1))
    if final:
        result["loss_curve_tail"] = final.get("loss_curve", [])[-3:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", default="1,2", help="comma-separated rank counts; the first is the baseline")
    ap.add_argument("--pairs", type=int, default=640)
    ap.add_argument("--global-batch", type=int, default=16, help="pairs per optimiser step, every count")
    ap.add_argument("--seq", type=int, default=1024, help="prompt + completion tokens (half each)")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--metrics-every", type=int, default=5, help="steps between the job's metrics lines")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU ranks (gloo): a smoke run")
    a = ap.parse_args()
    counts = [int(n) for n in a.gpus.split(",")]
    if any(a.global_batch % n for n in counts):
        ap.error(f"--global-batch {a.global_batch} must divide by every count in {counts}")
    import bench_gpu_dpo
    import bench_gpu_train

    prep = bench_gpu_train.prepare(argparse.Namespace(tiny=a.tiny, seq=a.seq, pairs=a.pairs),
                                   bench_gpu_dpo.model_config)
    work = bench_gpu_train.WORK
    reference = os.path.join(work, "ref_float32.parquet" if a.tiny else "ref_bfloat16.parquet")
    runs = [run_count(n, a, work, reference) for n in counts]
    base = runs[0].get("tokens_per_s")
    for run in runs:
        if base and run.get("tokens_per_s"):
            run["scaling_efficiency"] = round(run["tokens_per_s"] / (run["gpus"] / counts[0] * base), 3)
    report = {"settings": vars(a), "prepare": prep, "runs": runs}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "scaling.json"), "w") as f:
        json.dump(report, f, indent=1)
    for run in runs:
        print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main()
