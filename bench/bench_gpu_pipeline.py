"""The whole asset graph on one GPU at a real job's size, through Dagster, timed per asset.

    python3 bench/bench_gpu_pipeline.py --out DIR [--layers 24] [--prompts 512] [--samples 8] [--new-tokens 256]
        [--pairs 2000] [--engine static|vllm|transformers] [--runs 2] [--concurrent-steps 1,1,3]
        [--gpu-job-slots 2] [--cudnn-attention 0,1] [--dpo-self-play 0,1] [--warm-server 0,1]

Base model: the Qwen2-0.5B shape with its full 151,936-id vocabulary and random weights (bench/qwen_shape.py).
Data: `pairs` preference pairs written into a landing folder (correct vs wrong final answers to the
sample_data/real problems), the sample_data/real prompts (500 train, 200 held-out) and scored logs.
Runs `batchrl run --profile DIR/pipeline.yaml` with BATCHRL_ENV=gpu (every model stage on CUDA in bf16,
trainers and rollouts in Pipes subprocesses) while nvidia-smi samples GPU utilisation every 200 ms, then
reads the run's step start/end events from the Dagster instance: wall time per asset, GPU busy share
inside each asset's window, peak GPU memory, and orchestration overhead = total wall time minus the
time some asset step was running (process start, definitions, Dagster bookkeeping; for a sequential run
that is total minus the sum of the steps; ``idle_gaps``: where, stretch by stretch). Writes DIR/pipeline.json.
``--runs 2``: the graph again into fresh storage, with the compile caches and the job worker the first
run left (what a scheduled retrain on the same machine finds); each run's report under ``runs``.
``--concurrent-steps``: `batchrl run --concurrent-steps` per run (one value for all, or one per run), with
``--gpu-job-slots`` warm job workers (BATCHRL_GPU_JOB_SLOTS): independent branches share the GPU.
``--cudnn-attention`` / ``--dpo-self-play``: the jobs' BATCHRL_CUDNN_ATTENTION and the run's BATCHRL_DPO_SELF_PLAY,
per run like ``--concurrent-steps``. ``--existing-home``: each run's Dagster home has its tables before the timer
starts (by default the run creates them, as a first run on a machine does). ``--warm-server``: per run, whether
`batchrl serve` is up (started before the timer) so that `batchrl run` runs in a fork of it. ``--reselect A,B``:
after the runs, those assets once more into the last run's storage, the job workers warm (run "reselect").
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def write_inputs(out: str, pairs: int) -> dict:
    """Landing folder with `pairs` preference pairs built from the real task's problems."""
    rng = random.Random(0)
    problems = [json.loads(line) for line in open(os.path.join(REPO, "sample_data", "real", "train.jsonl"))]
    landing = os.path.join(out, "landing", "preferences")
    os.makedirs(landing, exist_ok=True)
    with open(os.path.join(landing, "pairs.jsonl"), "w") as f:
        for i in range(pairs):
            p = problems[i % len(problems)]
            wrong = int(p["answer"]) + rng.choice([-3, -2, -1, 1, 2, 5, 10])
            f.write(json.dumps({"prompt": p["prompt"], "chosen": f"The answer is {p['answer']}.\n#### {p['answer']}",
                                "rejected": f"The answer is {wrong}.\n#### {wrong} (try {i})"}) + "\n")
    return {"preferences": landing, "prompts": os.path.join(REPO, "sample_data", "real", "train.jsonl"),
            "eval_prompts": os.path.join(REPO, "sample_data", "real", "heldout.jsonl")}


def write_profile(out: str, model: str, landing: dict, a) -> str:
    import yaml

    profile = {
        "description": f"Qwen2-0.5B shape, {a.prompts} prompts x {a.samples} x {a.new_tokens} tokens, {a.pairs} pairs",
        "rl_iterations": 1,
        "resources": {"landing": landing,
                      "rollout_engine": {"max_new_tokens": a.new_tokens, "batch_size": 512, "kind": a.engine},
                      "compute": {"batch_size": 128}, "rl_recipe": {"samples_per_prompt": a.samples}},
        "ops": {
            "base_model": {"config": {"model_path": model}},
            "reward_model": {"config": {"epochs": 1, "lr": 1e-5, "micro_batch_size": 32, "max_length": 128}},
            "rollouts": {"config": {"max_prompts": a.prompts}},
            "rewards": {"config": {"rule": "final_answer", "weights": {"rule": 1.0, "reward_model": 0.5},
                                   "rm_batch_size": 128, "rm_max_length": 384}},
            "policy_checkpoint": {"config": {"lr": 1e-6, "micro_batch_size": 32, "grad_accum": 4,
                                             "max_length": 384}},
            "dpo_pairs": {"config": {"source": "logged"}},
            # short pairs: batches by tokens (32k padded tokens, ~250 pairs here) rather than 64 pairs
            "reference_logprobs": {"config": {"max_length": 128, "batch_size": 512, "batch_tokens": 32768}},
            "dpo_checkpoint": {"config": {"lr": 1e-6, "epochs": 1, "micro_batch_size": 32, "max_length": 128}},
            "evaluation": {"config": {"reward": "final_answer", "max_new_tokens": 64, "max_eval_prompts": 200}},
        },
    }
    path = os.path.join(out, "pipeline.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(profile, f, sort_keys=False)
    return path


TIMING_KEYS = ("engine_load_s", "generate_s", "write_s", "generated_tokens_per_s", "job_wall_s", "hash_s",
               "weight_cache_hits", "weight_cache_misses")


def step_windows(home: str, since: float = 0.0) -> list[dict]:
    """(asset, start, end) of every step of the runs in the instance (those started after ``since``), from the
    event log."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = home
    steps: dict[tuple[str, str], dict] = {}
    with dg.DagsterInstance.get() as instance:
        for run in instance.get_runs():
            for event in instance.all_logs(run.run_id):
                kind, key = event.dagster_event_type, event.step_key
                if key is None or kind is None:
                    continue
                box = steps.setdefault((run.run_id, key), {"asset": key})
                if kind == dg.DagsterEventType.STEP_START:
                    box["start"] = event.timestamp
                elif kind in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE):
                    box["end"], box["ok"] = event.timestamp, kind == dg.DagsterEventType.STEP_SUCCESS
                elif kind == dg.DagsterEventType.ASSET_MATERIALIZATION:  # the jobs' own timings
                    meta = event.dagster_event.event_specific_data.materialization.metadata
                    box["timings"] = {k: getattr(v, "value", v) for k, v in meta.items()
                                      if k.startswith("phase_s/") or k in TIMING_KEYS}
    return sorted((s for s in steps.values() if "start" in s and "end" in s and s["start"] >= since),
                  key=lambda s: s["start"])


def read_trace(path: str) -> list[tuple[float, float, float]]:
    """(unix time, GPU util %, memory used MiB) samples of nvidia-smi's CSV."""
    rows = []
    for line in csv.reader(open(path) if os.path.exists(path) else []):
        try:
            stamp = dt.datetime.strptime(line[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, float(line[1]), float(line[2])))
        except (ValueError, IndexError):
            continue
    return rows


def _bins(trace, start: float, end: float) -> list[list[float]]:
    """The utilisation samples of [start, end) in one-second bins (empty bins left out)."""
    bins: dict[int, list[float]] = {}
    for t, u, _ in trace:
        if start <= t < end:
            bins.setdefault(int(t - start), []).append(u)
    return [bins[k] for k in sorted(bins)]


def busy_time(windows: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) windows."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(windows):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def idle_gaps(steps: list[dict], started: float, total: float) -> list[dict]:
    """The orchestration overhead piece by piece: the stretches (10 ms or more) with no step running, from the
    command's start, between steps (named by the step that ended last and the one that starts) and to its end."""
    gaps, reach, last = [], started, "start"
    for step in sorted(steps, key=lambda step: step["start"]):
        if step["start"] - reach >= 0.01:
            gaps.append({"after": last, "before": step["asset"], "s": round(step["start"] - reach, 2)})
        if step["end"] > reach:
            reach, last = step["end"], step["asset"]
    if started + total - reach >= 0.01:
        gaps.append({"after": last, "before": "end", "s": round(started + total - reach, 2)})
    return gaps


def failure_lines(log: str, keep: int = 12) -> list[str]:
    """The run log's last lines that name an error: why a run failed, kept in the report."""
    lines = [line.rstrip()[:300] for line in open(log, errors="replace") if "Error" in line or "error" in line]
    return lines[-keep:]


def step_server_ready(home: str, started: float) -> float | None:
    """Seconds from the run's start until the step server had preloaded (its line in the run's log under the
    Dagster home: the console, which run.log holds, does not carry it), if the run had one. A warm server's own
    preload (server.log) was before the run and does not count."""
    times = [float(found) for log in glob.glob(os.path.join(home, "logs", "run-*.log"))
             for found in re.findall(r"step server: preloaded in [\d.]+ s, ready [\d.]+ s after start \(at ([\d.]+)\)",
                                     open(log, errors="replace").read())]
    times = [t for t in times if t >= started]
    return round(min(times) - started, 2) if times else None


def run_graph(profile: str, work: str, out: str, a, env: dict, concurrent_steps: int = 1,
              warm_server: bool = False, select: str | None = None) -> dict:
    """One `batchrl run` of the profile into a fresh storage root and Dagster home; its report. ``select``: only
    these assets, again, into the last run's storage and home (their inputs and the job workers as it left them)."""
    for folder in () if select else ("storage", "home"):  # a run before would be reused (completed jobs, partitions)
        shutil.rmtree(os.path.join(work, folder), ignore_errors=True)
    env = {**env, "BATCHRL_STORAGE": os.path.join(work, "storage"), "DAGSTER_HOME": os.path.join(work, "home")}
    os.makedirs(out, exist_ok=True)
    if a.existing_home and not select:
        from bench_run_startup import create_instance_tables  # this folder: the script's own

        create_instance_tables(env)
    batchrl = [sys.executable, "-c", "import sys; from batchrl.cli.main import console_main; console_main(sys.argv[1:])"]
    if warm_server:  # up before the timer, as the server a user keeps (`batchrl serve`): the run is a fork of it
        subprocess.run([*batchrl, "serve", "--detach"], env=env, check=True, capture_output=True)
    trace_path = os.path.join(out, "gpu_trace.csv")
    tracer = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used",
                               "--format=csv,noheader,nounits", "-lms", "200"], stdout=open(trace_path, "w")) \
        if shutil.which("nvidia-smi") else None  # none on a CPU box (smoke tests): no GPU figures
    started = time.time()
    cmd = [*batchrl, "run", "--profile", profile, "--concurrent-steps", str(concurrent_steps),
           *(["--select", select] if select else [])]
    with open(os.path.join(out, "run.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    total = time.time() - started
    if tracer is not None:
        tracer.terminate()
    if warm_server:
        subprocess.run([*batchrl, "serve", "--stop"], env=env, check=False, capture_output=True)
    trace = read_trace(trace_path)
    steps = step_windows(env["DAGSTER_HOME"], since=started)
    per_asset = []
    for s in steps:
        inside = [u for t, u, _ in trace if s["start"] <= t <= s["end"]]
        per_asset.append({"asset": s["asset"], "ok": s.get("ok"), "wall_s": round(s["end"] - s["start"], 2),
                          "start_s": round(s["start"] - started, 2),
                          # GPU busy % per second of the step: where inside it the GPU idles
                          "busy_per_s": [round(sum(b) / len(b)) for b in _bins(trace, s["start"], s["end"])],
                          "gpu_busy_mean_pct": round(sum(inside) / len(inside), 1) if inside else None,
                          "samples": len(inside), "job_timings": s.get("timings", {})})
    in_steps = busy_time([(s["start"], s["end"]) for s in steps])
    return {"rc": rc, "failure": failure_lines(os.path.join(out, "run.log")) if rc else None,
            # when the step server (concurrent runs) could fork its first step, from the run's start
            "step_server_ready_s": step_server_ready(env["DAGSTER_HOME"], started),
            "concurrent_steps": concurrent_steps, "warm_server": warm_server, "total_wall_s": round(total, 1),
            "sum_of_asset_steps_s": round(sum(p["wall_s"] for p in per_asset), 1),
            "some_step_running_s": round(in_steps, 1),
            "orchestration_overhead_s": round(total - in_steps, 1),
            "orchestration_overhead_pct": round(100 * (total - in_steps) / total, 1) if total else None,
            "idle_gaps": idle_gaps(steps, started, total),
            "peak_gpu_memory_gib": round(max((m for _, _, m in trace), default=0) / 1024, 1),
            "gpu_busy_whole_run_pct": round(sum(u for _, u, _ in trace) / len(trace), 1) if trace else None,
            "per_asset": per_asset}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    for flag, default in (("--layers", 24), ("--prompts", 512), ("--samples", 8), ("--new-tokens", 256),
                          ("--pairs", 2000), ("--timeout", 560)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--engine", default="static", choices=["static", "vllm", "transformers"])
    ap.add_argument("--jobs", default="worker", choices=["subprocess", "worker"],
                    help="worker: one-process jobs in the long-lived warm job worker (BATCHRL_JOB_BACKEND)")
    ap.add_argument("--runs", type=int, default=1, help=(
        "runs of the graph, each into fresh storage: the first with empty compile caches and no job worker "
        "(a first-ever run); later ones keep the caches and the worker of the run before (a retrain on the "
        "same machine)"))
    ap.add_argument("--concurrent-steps", default="1", help=(
        "batchrl run --concurrent-steps: one value for every run, or comma-separated, one per run"))
    ap.add_argument("--gpu-job-slots", type=int, default=1, help="warm job workers sharing the GPU")
    ap.add_argument("--cudnn-attention", default="0", help=(
        "BATCHRL_CUDNN_ATTENTION of the jobs (1: torch may pick cuDNN attention for masked batches), one value "
        "for every run or comma-separated, one per run"))
    ap.add_argument("--dpo-self-play", default="0", help=(
        "BATCHRL_DPO_SELF_PLAY of the run (1: dpo_pairs keeps its rewards input, so the DPO path waits for the RL "
        "branch, as before the tenth session), one value or one per run"))
    ap.add_argument("--existing-home", action="store_true", help=(
        "create each run's fresh Dagster home's tables before the timer starts (a machine that ran batchrl before; "
        "default: the run creates them, ~0.5 s of its start-up on the dev box, as in the sessions up to the tenth)"))
    ap.add_argument("--warm-server", default="0", help=(
        "1: `batchrl serve` is started (untimed) before the run, which then runs in a fork of it (a user who keeps "
        "the server up); one value or one per run"))
    ap.add_argument("--reselect", help=(
        "after the runs, materialise these comma-separated assets again into the last run's storage (the job "
        "workers as it left them: e.g. the base model's weights in their cache), reported as run 'reselect'"))
    ap.add_argument("--profile-jobs", action="store_true", help=(
        "with --reselect: those assets a second time with BATCHRL_PROFILE_JOBS (torch profiler per job: where each "
        "job left the GPU idle), reported as run 'reselect-profiled' with the jobs' summaries"))
    a = ap.parse_args()
    concurrency, cudnn, self_play, warm = (per_run(ap, flag, value, a.runs) for flag, value in (
        ("--concurrent-steps", a.concurrent_steps), ("--cudnn-attention", a.cudnn_attention),
        ("--dpo-self-play", a.dpo_self_play), ("--warm-server", a.warm_server)))
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    work = "/tmp/bench-pipeline"
    from bench.qwen_shape import build

    t0 = time.time()
    model = build(os.path.join(work, "model"), layers=a.layers)
    build_s = time.time() - t0
    profile = write_profile(out, model, write_inputs(work, a.pairs), a)
    caches = os.path.join(work, "compile-cache")  # shared by the runs, empty for the first
    shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, "BATCHRL_ENV": "gpu", "HF_HUB_OFFLINE": "1",
           "BATCHRL_JOB_BACKEND": a.jobs, "BATCHRL_GPU_JOB_SLOTS": str(a.gpu_job_slots),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
    runs = []
    for k in range(a.runs):  # the report is rewritten after each run: a run cut short keeps the ones before
        runs.append({"run": k + 1, "caches": "cold" if k == 0 else "warm",
                     "cudnn_attention": cudnn[k], "dpo_self_play": self_play[k],
                     **run_graph(profile, work, out if a.runs == 1 else os.path.join(out, f"run{k + 1}"), a,
                                 {**env, "BATCHRL_CUDNN_ATTENTION": str(cudnn[k]),
                                  "BATCHRL_DPO_SELF_PLAY": str(self_play[k])}, concurrency[k], bool(warm[k]))})
        report = {**runs[-1], "model_build_s": round(build_s, 1), "settings": vars(a)}
        with open(os.path.join(out, "pipeline.json"), "w") as f:
            json.dump({**report, "runs": runs} if a.runs > 1 else report, f, indent=1)
        print_run(runs[-1])
    # the stages again on their own, the workers warm (a re-materialisation from the UI, say); then profiled
    for name in ("reselect", "reselect-profiled")[:(1 + a.profile_jobs) if a.reselect else 0]:
        profiles = os.path.join(out, name, "job-profiles")
        runs.append({"run": name, "caches": "warm", "select": a.reselect,
                     **run_graph(profile, work, os.path.join(out, name), a,
                                 {**env, "BATCHRL_CUDNN_ATTENTION": str(cudnn[-1]),
                                  "BATCHRL_DPO_SELF_PLAY": str(self_play[-1]),
                                  **({"BATCHRL_PROFILE_JOBS": profiles} if name.endswith("profiled") else {})},
                                 concurrency[-1], bool(warm[-1]), select=a.reselect)})
        if os.path.isdir(profiles):
            runs[-1]["job_profiles"] = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(profiles, "*.json")))]
        with open(os.path.join(out, "pipeline.json"), "w") as f:
            json.dump({**runs[a.runs - 1], "model_build_s": round(build_s, 1), "settings": vars(a), "runs": runs},
                      f, indent=1)
        print_run(runs[-1])
    # the warm job workers outlive the runs (they wait for the next one): stop them, keep their logs
    subprocess.run(["pkill", "-f", "batchrl.training.jobs.worker --socket"], check=False)
    logs = sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"batchrl-workers-{os.getuid()}", "*.log")))
    for k, log in enumerate(logs):
        shutil.copy(log, os.path.join(out, "worker.log" if k == 0 else f"worker-{k}.log"))


def per_run(ap, flag: str, value: str, runs: int) -> list[int]:
    """A flag's value for each run: one for all, or one per run (comma-separated)."""
    values = [int(v) for v in value.split(",")]
    values = values * runs if len(values) == 1 else values
    if len(values) != runs:
        ap.error(f"{flag}: {len(values)} values for {runs} runs")
    return values


def print_run(run: dict) -> None:
    print(json.dumps({k: v for k, v in run.items() if k not in ("per_asset", "job_profiles")}), flush=True)
    for job in run.get("job_profiles", []):
        print(f"  profile {job['job']}: wall {job['wall_s']} s, GPU busy {job['gpu_busy_s']} s "
              f"({job['gpu_busy_pct']}%), phases {json.dumps(job['phases'])}", flush=True)
        for gap in job["gaps"][:8]:
            print(f"    gap {json.dumps(gap)}", flush=True)
    for p in run["per_asset"]:
        timings = " ".join(f"{k.removeprefix('phase_s/')}={v:.1f}" for k, v in p["job_timings"].items()
                           if isinstance(v, (int, float)))
        print(f"  {p['asset']:<28} {p['start_s']:>6.1f} +{p['wall_s']:>6.1f} s  GPU busy {p['gpu_busy_mean_pct']}%  "
              f"ok={p['ok']}  {timings}", flush=True)


if __name__ == "__main__":
    main()
