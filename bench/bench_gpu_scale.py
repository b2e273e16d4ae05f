"""GPU benchmark of issue 30 (models of real size): random-weight Qwen2.5-1.5B / -7B shapes built on the device,
DPO with LoRA at the 7B shape against TRL 1.16 DPOTrainer + PEFT in the same run, the whole asset graph at 7B
with LoRA and at 1.5B with full fine-tuning, and the SmolLM2 real-model run with LoRA beside full fine-tuning.

Each part runs in its own subprocess (clean peak memory; one failure does not stop the rest). Results go to
$OUT/gpu_scale.json and to /tmp/scale/gpu_scale.json, which a later call on the same (still warm) machine
continues, so parts spread over several device calls end in one report. A summary is printed at the end.

Parts (``--parts a,b,...``; groups: ``dpo`` = shape_7b,dpo_prepare,dpo_lora,dpo_lora_trl):
  shape_0.5b, shape_1.5b, shape_7b  the Qwen2 / Qwen2.5 shape (full 151,936 vocab, synthetic BPE tokenizer, bench/qwen_shape.py) built
             in bf16 on the GPU and written as safetensors to /tmp/scale/<shape>; skipped when already there.
  dpo_prepare  pairs of prompt + completion text, every row exactly --seq tokens (half each) with the shape's
             tokenizer, and batchrl's reference pass (bf16, timed; its model load and tokenisation timed apart).
  dpo_lora   batchrl's real ``train_dpo`` job (bench_gpu_train.part_dpo) with LoRA r16/a32 on all linear layers,
             bf16, ZeRO-0, fused log-probs, no gradient checkpointing; ``dpo_lora_compile``: + torch.compile.
  dpo_lora_trl  TRL DPOTrainer + peft LoraConfig (same rank/alpha/targets, batch, length,
             precompute_ref_log_probs, no gradient checkpointing); ``dpo_lora_trl_gc``: TRL's gradient checkpointing.
  graph_0.5b_full (issue 32's third goal: an RL iteration <= 1.2x its generation + optimiser steps),
  graph_7b_lora, graph_1.5b_full  the whole graph (bench_gpu_pipeline.run_graph) at that shape, LoRA (ZeRO-0) or
             full fine-tuning (ZeRO-2) on all five trainers, bf16: per-asset wall, GPU busy, peak memory, artifact
             sizes, the RL iteration's wall and its fixed costs (bench/scale_graph.py; --graph-* flags size it).
  real_full, real_lora  (d) `batchrl run --profile real` for --real-minutes, full fine-tuning / LoRA; held-out
             evaluation of each (needs the graph bundle with the SmolLM2 GGUF).
  dpo_ref_profile  batchrl's DPO reference pass at the shape (after dpo_prepare: its model folder and pairs), cold
             (fresh Triton cache) and warm with its phases, then its pieces timed apart on one loaded model (decoder
             with/without mask and position ids, fused LM head, naive logits path) beside a plain bf16
             ``model(input_ids)`` forward of the same batches; torch.profiler's top kernels of each.

Here, once (wheels for the device; see bench/gpu_wheels.sh and bench/carry.py):
    bash bench/gpu_wheels.sh                     # .whl/: deepspeed, pydantic, trl, datasets, peft (~12 MiB)
    DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w /tmp/dsw
    python bench/carry.py prepare graph --requirements preset:graph --wheel-dir /tmp/dsw   # parts of <= 56 MiB
Device calls (run tool, kind nvidia-h200, in this order, each < 10 min; the machine must stay warm between
calls, so make them back to back; ``source bench/device_env.sh`` installs .whl into /tmp/site once):
 1. (c) DPO LoRA, ~5 min.  carry [".whl"]
      source bench/device_env.sh; python3 bench/bench_gpu_scale.py --parts dpo
    (device_env.sh returns non-zero for the missing graph bundle: that is fine here, PYTHONPATH is set first)
 2..k. the graph bundle, one call per part, ~10 s each.  carry [".carry/graph/part-00N"]
      source bench/device_env.sh .carry/graph/part-00N
 k+1. (b) 1.5B full fine-tuning graph, ~6 min.  carry []
      source bench/device_env.sh && python3 bench/bench_gpu_scale.py --parts shape_1.5b,graph_1.5b_full
 k+2. (a) 7B LoRA graph, ~8 min.  carry []
      source bench/device_env.sh && python3 bench/bench_gpu_scale.py --parts shape_7b,graph_7b_lora
 issue 32's 0.5B goal, the loop as the real profile trains (resident trainer: ZeRO-0, bf16_amp), ~4 min.  carry []
      source bench/device_env.sh && python3 bench/bench_gpu_scale.py --parts shape_0.5b,graph_0.5b_full \
        --graph-full-zero-stage 0 --graph-precision bf16_amp --graph-rl-iterations 4
 k+3, k+4. (d) real run, full then LoRA, ~8 min each.  carry []
      source bench/device_env.sh && python3 bench/bench_gpu_scale.py --parts real_full
      source bench/device_env.sh && python3 bench/bench_gpu_scale.py --parts real_lora
 k+5. the reference pass profiled, ~3 min.  carry []
      source bench/device_env.sh && python3 bench/bench_gpu_scale.py --parts shape_7b,dpo_prepare,dpo_ref_profile
If the machine went cold in between, /tmp is empty: carry [".whl"] (and the graph parts) again; shapes rebuild.
CPU smoke test here: PYTHONPATH=/tmp/trl_site .venv/bin/python bench/bench_gpu_scale.py --tiny --parts all
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import bench_gpu_dpo as dpo_bench  # noqa: E402  (peak_gib, reset_peak, environment)
import bench_gpu_train as train_parts  # noqa: E402  (part_dpo: batchrl's train_dpo, timed)
import scale_graph  # noqa: E402  (graph_* and real_* parts)
import scale_ref_profile  # noqa: E402  (dpo_ref_profile)

SHAPE_NAMES = {"0.5b": "qwen2-0.5b", "1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}
PARTS = ("shape_0.5b", "shape_1.5b", "shape_7b", "dpo_prepare", "dpo_lora", "dpo_lora_compile", "dpo_lora_trl", "dpo_lora_trl_gc",
         "graph_0.5b_full", "graph_1.5b_full", "graph_7b_lora", "real_full", "real_lora", "dpo_ref_profile")
GROUPS = {"dpo": "shape_7b,dpo_prepare,dpo_lora,dpo_lora_trl",
          "all": "shape_1.5b,shape_7b,dpo_prepare,dpo_lora,dpo_lora_trl,graph_1.5b_full,graph_7b_lora,real_full,real_lora"}
NOT_ON_CPU = {"dpo_lora_compile"}  # minutes of inductor on 2 cores: GPU only


# -------------------------------------------------------------------------------------------- shapes
def shape_dir(args, key: str) -> str:
    return os.path.join(args.work, "tiny-" + key if args.tiny else SHAPE_NAMES[key])


def part_shape(args, key: str) -> dict:
    """The shape's folder (weights + BPE tokenizer), built in bf16 on the device unless already there."""
    import resource

    import torch
    from safetensors import safe_open

    from qwen_shape import build

    path = shape_dir(args, key)
    out = {"shape": "tiny" if args.tiny else SHAPE_NAMES[key], "path": path}
    if not os.path.exists(os.path.join(path, "READY")):
        dpo_bench.reset_peak(args.device)
        t = time.perf_counter()
        build(path, shape=out["shape"], device=args.device, dtype="bfloat16")
        out["build_s"] = time.perf_counter() - t
        out["peak_gpu_gib"] = dpo_bench.peak_gib(args.device)
        open(os.path.join(path, "READY"), "w").close()
    else:
        out["reused"] = True
    weights = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    params = 0
    for f in weights:
        with safe_open(f, "pt") as st:
            params += sum(torch.Size(st.get_slice(k).get_shape()).numel() for k in st.keys())
    out.update(params=params, weight_bytes=sum(os.path.getsize(f) for f in weights),
               host_max_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return out


# ----------------------------------------------------------------------------------------------- DPO
def lora_fields(args) -> dict:
    return dict(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_target_modules=["all-linear"])


def part_dpo_prepare(args) -> dict:
    """bench_gpu_train's model folder, pairs and reference pass, at the shape: the built weights (linked, not
    copied). (A word-level tokenizer, as bench_gpu_train's, is not used: transformers 5 loads a Qwen2 folder's
    tokenizer as Qwen2Tokenizer, which rebuilds it as byte-level BPE and drops every word.)"""
    import random

    import pandas as pd
    from transformers import AutoTokenizer

    from batchrl.training.models import loading
    from batchrl.training.trainer import reference

    base = shape_dir(args, "7b")
    if not os.path.exists(os.path.join(base, "READY")):
        part_shape(args, "7b")
    work, model_dir = train_parts.WORK, os.path.join(train_parts.WORK, "model")
    os.makedirs(model_dir, exist_ok=True)
    for name in os.listdir(base):
        if name.endswith(".json") and not name.startswith(("tokenizer", "special_tokens", "chat_template")) \
                or name.endswith(".safetensors"):
            link = os.path.join(model_dir, name)
            if not os.path.lexists(link):
                os.symlink(os.path.join(base, name), link)
    # the base's BPE tokenizer without its chat template (TRL's plain prompts get none either); rows are built
    # from space-led words of 1-3 letters, which tokenise independently, to exactly `half` tokens each
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = None
    tok.save_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pool = [" " + "".join(rng.choice(letters) for _ in range(rng.randint(1, 3))) for _ in range(4000)]
    by_len: dict[int, list[str]] = {}
    for word, ids in zip(pool, tok(pool, add_special_tokens=False)["input_ids"]):
        by_len.setdefault(len(ids), []).append(word)
    sizes = sorted(by_len)  # 1..4 tokens at the full vocabulary; 2..4 in the tiny one

    def text(n: int) -> str:
        words, left = [], n
        while left > 0:  # a word that leaves nothing, or enough for another
            k = rng.choice([s for s in sizes if s == left or left - s >= sizes[0]])
            words.append(rng.choice(by_len[k]))
            left -= k
        return "".join(words)

    half = args.seq // 2
    pd.DataFrame({"id": [str(i) for i in range(args.pairs)], "prompt": [text(half) for _ in range(args.pairs)],
                  "chosen": [text(half - 1) for _ in range(args.pairs)],  # + eos = half tokens
                  "rejected": [text(half - 1) for _ in range(args.pairs)]}).to_parquet(f"{work}/pairs.parquet")
    setup_s: list[float] = []

    def timed(fn):  # model load and tokenisation inside the pass: TRL's precompute starts after both
        def wrapper(*a, **kw):
            train_parts._sync(); t0 = time.perf_counter()
            result = fn(*a, **kw)
            train_parts._sync(); setup_s.append(time.perf_counter() - t0)
            return result
        return wrapper

    loading.load_model_and_tokenizer = timed(loading.load_model_and_tokenizer)
    reference.encode_pairs = timed(reference.encode_pairs)
    dpo_bench.reset_peak(args.device)
    t = time.perf_counter()
    stats = reference.compute_reference_logprobs(model_dir, f"{work}/pairs.parquet", f"{work}/ref_bfloat16.parquet",
                                                 max_length=args.seq, batch_size=args.ref_batch, dtype="bfloat16")
    out = {"reference_pass_bfloat16_s": time.perf_counter() - t,
           "reference_pass_bfloat16_load_and_tokenise_s": sum(setup_s),
           "reference_mean_chosen_len_bfloat16": stats["mean_chosen_len"], "peak_gib": dpo_bench.peak_gib(args.device)}
    if stats["mean_chosen_len"] != half:  # each row must be exactly prompt (half) + completion (half - 1 + eos)
        out["error"] = f"completions tokenise to {stats['mean_chosen_len']} tokens, not {half}"
    with open(f"{work}/prepare.json", "w") as f:
        json.dump(out, f)
    return out


def part_dpo_lora(args, compile_: bool) -> dict:
    """bench_gpu_train.part_dpo (timing, margin and save passes kept apart) with a LoRA variant."""
    train_parts.DPO_VARIANTS.update(  # cumulative over the variants before: set every knob that matters
        lora=dict(fused_logprobs=True, group_by_length=False, metrics_every=args.metrics_every, zero_stage=0,
                  precision="bf16", torch_compile=False, **lora_fields(args)),
        lora_compile=dict(torch_compile=True))
    out = train_parts.part_dpo(args, "lora_compile" if compile_ else "lora", dpo_bench.peak_gib, dpo_bench.reset_peak)
    adapter = os.path.join(train_parts.WORK, f"dpo_{out['variant']}", "model")
    if os.path.isdir(adapter):
        out["adapter_bytes"] = sum(os.path.getsize(os.path.join(adapter, f)) for f in os.listdir(adapter))
    return out


def part_trl_lora(args, checkpointing: bool) -> dict:
    """TRL 1.16 DPOTrainer + PEFT on the same model folder, pairs and batch (bench_gpu_dpo.part_trl's timing)."""
    try:
        import datasets
        import trl
    except ImportError as e:
        return {"skipped": f"TRL side not run: {e!r} (carry .whl from bench/gpu_wheels.sh; here PYTHONPATH=/tmp/trl_site)"}
    import pandas as pd
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    model_dir, sync = os.path.join(train_parts.WORK, "model"), lambda: train_parts._sync()
    pairs = pd.read_parquet(os.path.join(train_parts.WORK, "pairs.parquet"))
    data = datasets.Dataset.from_pandas(pairs[["prompt", "chosen", "rejected"]], preserve_index=False)
    stamps, precompute_s = [], []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            sync(); stamps.append(time.perf_counter())

    original = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **kw):  # TRL runs its reference pass inside the constructor
        sync(); t = time.perf_counter()
        result = original(self, *a, **kw)
        sync(); precompute_s.append(time.perf_counter() - t)
        return result

    DPOTrainer._precompute_ref_logps = timed_precompute
    cuda = args.device == "cuda"
    config = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch, max_length=args.seq + 8,
                       bf16=cuda, num_train_epochs=1, logging_steps=20, report_to="none", save_strategy="no",
                       learning_rate=1e-5, dataloader_num_workers=2, precompute_ref_log_probs=True,
                       precompute_ref_batch_size=args.ref_batch, gradient_checkpointing=checkpointing, use_cpu=not cuda)
    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                           task_type="CAUSAL_LM", bias="none")
    dpo_bench.reset_peak(args.device)
    sync(); t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa").to(args.device)
    sync(); load_s = time.perf_counter() - t0
    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(
        model_dir), peft_config=lora)
    sync(); init_s = time.perf_counter() - t0 - load_s
    trainer.add_callback(StepClock())
    sync(); t1 = time.perf_counter()
    trainer.train()
    sync(); train_s = time.perf_counter() - t1
    steps, tokens_epoch = len(stamps), args.pairs * 2 * args.seq
    skip = max(1, min(args.metrics_every, steps // 2))  # the same window as batchrl's first metrics read
    steady = (stamps[-1] - stamps[skip - 1]) / (steps - skip) if steps > skip else float("nan")
    ref_s = sum(precompute_s)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    ds = trainer.train_dataset  # TRL's tokenised rows: the same lengths as batchrl's (half + half)
    lengths = {c: sum(map(len, ds[c])) / len(ds) for c in ds.column_names if c.endswith("ids")}
    return {"trl_version": trl.__version__, "peft_version": peft.__version__, "gradient_checkpointing": checkpointing,
            "steps": steps, "model_load_s": load_s, "constructor_s": init_s, "reference_precompute_s": ref_s,
            "train_s": train_s, "trainable_params": trainable, "mean_tokens": lengths,
            "epoch_tokens_per_s_train_only": tokens_epoch / train_s,
            "epoch_tokens_per_s_with_ref_pass": tokens_epoch / (train_s + ref_s),
            "epoch_tokens_per_s_trl_scope": tokens_epoch / (train_s + ref_s),
            "steady_step_s": steady, "steady_tokens_per_s": 2 * args.batch * args.seq / steady,
            "peak_gib": dpo_bench.peak_gib(args.device)}


# ------------------------------------------------------------------------------------------ driver
def run_part(args) -> None:
    part = args.part
    fns = {"shape_0.5b": lambda a: part_shape(a, "0.5b"), "shape_1.5b": lambda a: part_shape(a, "1.5b"),
           "shape_7b": lambda a: part_shape(a, "7b"),
           "graph_0.5b_full": lambda a: scale_graph.part_graph(a, shape_dir(a, "0.5b"), lora=False),
           "dpo_prepare": part_dpo_prepare, "dpo_lora": lambda a: part_dpo_lora(a, False),
           "dpo_lora_compile": lambda a: part_dpo_lora(a, True), "dpo_lora_trl": lambda a: part_trl_lora(a, False),
           "dpo_lora_trl_gc": lambda a: part_trl_lora(a, True),
           "graph_1.5b_full": lambda a: scale_graph.part_graph(a, shape_dir(a, "1.5b"), lora=False),
           "graph_7b_lora": lambda a: scale_graph.part_graph(a, shape_dir(a, "7b"), lora=True),
           "real_full": lambda a: scale_graph.part_real(a, lora=False),
           "real_lora": lambda a: scale_graph.part_real(a, lora=True), "dpo_ref_profile": scale_ref_profile.part_dpo_ref_profile}
    try:
        result = fns[part](args)
    except Exception as e:
        traceback.print_exc()
        result = {"error": repr(e)[:800]}
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1, default=str)


def summary(res: dict) -> str:
    k = lambda v: f"{v / 1e3:7.1f}k" if isinstance(v, (int, float)) else "    n/a"
    g = lambda v: f"{v:6.1f}" if isinstance(v, (int, float)) else "   n/a"
    lines = []
    for key in ("shape_0.5b", "shape_1.5b", "shape_7b"):
        if "params" in res.get(key, {}):
            r = res[key]
            lines.append(f"{key}: {r['params'] / 1e9:.2f}B params, {r['weight_bytes'] / 2**30:.1f} GiB on disk, build "
                         f"{g(r.get('build_s'))} s{' (reused)' * bool(r.get('reused'))}, host RSS {r['host_max_rss_gib']:.1f} GiB")
    lines.append("DPO LoRA: path | steady tok/s | epoch tok/s incl. ref pass (TRL's scope) | incl. load | peak GiB")
    for name in ("dpo_lora", "dpo_lora_compile", "dpo_lora_trl", "dpo_lora_trl_gc"):
        r = res.get(name, {})
        if "steady_tokens_per_s" in r:
            lines.append(f"  {name:18s} {k(r['steady_tokens_per_s'])} {k(r['epoch_tokens_per_s_trl_scope'])} "
                         f"{k(r['epoch_tokens_per_s_with_ref_pass'])} {g(r['peak_gib'])}")
    for ours in ("dpo_lora", "dpo_lora_compile"):
        a, b = res.get(ours, {}), res.get("dpo_lora_trl", {})
        if "steady_tokens_per_s" in a and "steady_tokens_per_s" in b:
            lines.append(f"  ratio {ours}/TRL: steady {a['steady_tokens_per_s'] / b['steady_tokens_per_s']:.2f}x, epoch "
                         f"{a['epoch_tokens_per_s_trl_scope'] / b['epoch_tokens_per_s_trl_scope']:.2f}x, peak memory "
                         f"{a['peak_gib'] / b['peak_gib'] if b['peak_gib'] else float('nan'):.2f}x (goal: >= 1.3x at <= 1x)")
    lines += scale_graph.summary_lines(res)
    lines += [f"  {p} FAILED: {r['error'][:300]}" for p, r in res.items() if isinstance(r, dict) and "error" in r]
    lines += [f"  {p} skipped: {r['skipped']}" for p, r in res.items() if isinstance(r, dict) and "skipped" in r]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="dpo", help=f"comma-separated parts or groups {sorted(GROUPS)}; parts: {PARTS}")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/scale")
    p.add_argument("--fresh", action="store_true", help="do not continue /tmp/scale/gpu_scale.json of an earlier call")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, a few steps: CPU smoke test")
    p.add_argument("--pairs", type=int, default=64, help="DPO pairs per epoch")
    p.add_argument("--batch", type=int, default=4, help="DPO pairs per step (rows = 2x)")
    p.add_argument("--seq", type=int, default=1024, help="prompt + completion tokens (half each)")
    p.add_argument("--ref-batch", type=int, default=16, help="rows per reference-pass batch (both trainers)")
    p.add_argument("--metrics-every", type=int, default=2, help="batchrl's steps between metrics reads")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--real-minutes", type=float, default=6.0, help="(d): each real run's training minutes")
    p.add_argument("--part-timeout", type=int, default=560)
    scale_graph.add_args(p)
    args = p.parse_args()
    if args.tiny:  # a few steps at toy size
        args.pairs, args.batch, args.seq, args.ref_batch = min(args.pairs, 8), min(args.batch, 2), min(args.seq, 64), 4
        args.work = args.work.rstrip("/") + "-tiny"
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    train_parts.WORK = os.path.join(args.work, "dpo")
    os.makedirs(train_parts.WORK, exist_ok=True)
    if args.part:
        return run_part(args)
    parts = [q for item in args.parts.split(",") for q in GROUPS.get(item, item).split(",")]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}")
    out_dir = os.environ.get("OUT", "bench/out")
    os.makedirs(out_dir, exist_ok=True)
    keep = os.path.join(args.work, "gpu_scale.json")
    res = json.load(open(keep)) if os.path.exists(keep) and not args.fresh else {}
    res.update(environment=dpo_bench.environment(), argv=sys.argv[1:])
    print(json.dumps(res["environment"]), flush=True)
    argv = sys.argv[1:]  # forwarded to each part, less --parts
    forward = [a for i, a in enumerate(argv) if a != "--parts" and not a.startswith("--parts=")
               and (i == 0 or argv[i - 1] != "--parts")]
    for part in parts:
        if args.device == "cpu" and part in NOT_ON_CPU:
            res[part] = {"skipped": "GPU only (torch.compile of the 7B layers)"}
            continue
        result_file = tempfile.mktemp(suffix=f"-{part}.json")
        t = time.perf_counter()
        print(f"=== {part}", flush=True)
        try:
            subprocess.run([sys.executable, __file__, *forward, "--part", part, "--result", result_file],
                           timeout=args.part_timeout, check=False)
            with open(result_file) as f:
                res[part] = json.load(f)
        except Exception as e:
            res[part] = {"error": repr(e)[:500]}
        res[part]["part_wall_s"] = time.perf_counter() - t
        for path in (os.path.join(out_dir, "gpu_scale.json"), keep):
            with open(path, "w") as f:
                json.dump(res, f, indent=1, default=str)
    print(summary(res), flush=True)


if __name__ == "__main__":
    main()
