"""GPU benchmark: batchrl's trainer jobs (DPO per trainer variant, reward model, policy update) against
TRL's DPOTrainer, and the chunked LM-head log-probs against the naive full-logits path, in one run.

Model: Qwen2-0.5B shape with random weights (hidden 896, 24 layers, 14/2 heads, vocab 151936, tied
embeddings), pairs of 512 prompt + 512 completion tokens, 8 pairs (16 rows) per step, bf16.
Tokens per step = 2 x pairs x seq. Each part runs in its own subprocess (clean peak memory, its
own process group, one failure does not stop the rest); results go to $OUT/gpu_bench.json.

Parts:
  logprobs  token_logprobs_from_hidden (chunked; Triton row kernels on GPUs) vs lm_head +
            token_logprobs_from_logits, fwd+bwd, batch 16 x 1024 x 151936: peak memory, time, max |diff|.
  prepare   model folder, pairs and the reference pass (bench_gpu_train.prepare; bf16 and fp32, timed).
  dpo_<v>   batchrl's real ``train_dpo`` job per trainer variant (bench_gpu_train.DPO_VARIANTS, cumulative:
            baseline = last session's trainer, then fused log-probs, no host syncs, ZeRO-0, bf16 autocast,
            torch.compile), one epoch each.
  profile_<v>  torch profile of the steady DPO step of variant v (GPU time per kernel category and phase).
  reward_model, policy  the same trainer's RM and policy-update jobs with the fastest DPO variant
            (profile_reward_model: the RM step's torch profile, as profile_<v>).
  trl_*     TRL DPOTrainer (precompute_ref_log_probs / default; TRL's defaults include gradient
            checkpointing and its fused chunked LM head; ``_nogc``: precompute without checkpointing),
            one epoch; the constructor (which runs TRL's reference precompute) and train() are timed
            separately.

    bash bench/gpu_wheels.sh   # once, here: wheels for deepspeed/trl/datasets/pydantic into .whl/
    # on the device (run tool, carry [".whl"]):
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/batchrl && export PYTHONPATH=/tmp/pkg:/tmp/site
    python3 bench/bench_gpu_dpo.py --pairs 320
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

VOCAB, HIDDEN = 151936, 896
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_train as train_parts  # noqa: E402  (batchrl's trainer parts)

PARTS = ("logprobs", "prepare", *(f"dpo_{v}" for v in train_parts.DPO_VARIANTS), "dpo_compile_warm", "profile_baseline",
         "profile_best", "reward_model", "profile_reward_model", "policy", "trl_precompute", "trl_precompute_nogc", "trl_default")
DEFAULT_PARTS = tuple(p for p in PARTS if p != "trl_default")
ANCHORS_K = {"trl_precompute_epoch": 64.7, "trl_default_epoch": 34.9, "eager_torch_dpo_step": 59.5,
             "deepspeed_zero2_sft_step": 85.8}


def model_config(tiny: bool):
    from transformers import Qwen2Config

    if tiny:  # CPU smoke test of the script itself
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096,
                           tie_word_embeddings=True)
    return Qwen2Config(hidden_size=HIDDEN, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
                       tie_word_embeddings=True)


def make_model(args, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # same weights for every variant and for the reference
    model = AutoModelForCausalLM.from_config(model_config(args.tiny), attn_implementation="sdpa",
                                             dtype=dtype or torch.float32)
    return model.to(args.device)


def sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device, base=0):
    import torch

    if torch.device(device).type != "cuda":
        return float("nan")
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def reset_peak(device):
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------------------- logprobs
def part_logprobs(args) -> dict:
    import torch

    from batchrl.training.algos import token_logprobs_from_hidden, token_logprobs_from_logits

    dev, vocab = args.device, (1024 if args.tiny else VOCAB)
    hid = 64 if args.tiny else HIDDEN
    B, S = 2 * args.batch, args.seq
    gen = torch.Generator(device=dev).manual_seed(1)
    hidden = torch.randn(B, S, hid, device=dev, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, hid, device=dev, generator=gen) / hid**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (B, S), device=dev, generator=gen)
    variants = {"naive": lambda h, w: token_logprobs_from_logits(h @ w.t(), labels)}
    for cs in args.chunk_sizes:
        variants[f"chunked_{cs}"] = (lambda c: lambda h, w: token_logprobs_from_hidden(h, w, labels, chunk_size=c))(cs)

    def fwd_bwd(fn):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        lp = fn(h, w)
        lp.sum().backward()
        return lp.detach(), h.grad, w.grad

    out, results = {"shape": [B, S, hid, vocab], "dtype": "bfloat16"}, {}
    for name, fn in variants.items():
        for _ in range(2):  # warm-up
            fwd_bwd(fn)
        reset_peak(dev)
        base = torch.cuda.memory_allocated() if dev == "cuda" else 0
        results[name] = fwd_bwd(fn)
        sync(dev)
        rec = {"fwd_bwd_peak_extra_gib": peak_gib(dev, base)}
        reset_peak(dev)
        with torch.no_grad():
            fn(hidden, weight)
        sync(dev)
        rec["fwd_nograd_peak_extra_gib"] = peak_gib(dev, base)
        times = []
        for _ in range(args.reps):
            if dev == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(); fwd_bwd(fn); end.record(); torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter(); fwd_bwd(fn); times.append(1e3 * (time.perf_counter() - t))
        rec["fwd_bwd_ms_median"] = statistics.median(times)
        rec["fwd_bwd_ms_all"] = times
        out[name] = rec
        print("logprobs", name, {k: v for k, v in rec.items() if k != "fwd_bwd_ms_all"}, flush=True)
    # accuracy: each path against the naive one and against fp32 logits of the same bf16 inputs
    with torch.no_grad():
        ref32 = token_logprobs_from_logits(hidden.float() @ weight.float().t(), labels)
    lp_n, gh_n, gw_n = results["naive"]
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    out["naive_vs_fp32_logits_max_abs"] = float((lp_n - ref32).abs().max())
    for name, (lp, gh, gw) in results.items():
        if name == "naive":
            continue
        out[name].update(max_abs_diff_vs_naive=float((lp - lp_n).abs().max()),
                         max_abs_diff_vs_fp32_logits=float((lp - ref32).abs().max()),
                         grad_hidden_rel_err_vs_naive=rel(gh, gh_n), grad_weight_rel_err_vs_naive=rel(gw, gw_n))
        print("logprobs accuracy", name, {k: v for k, v in out[name].items() if "diff" in k or "err" in k}, flush=True)
    return out


# ---------------------------------------------------------------------------------------------- TRL
def part_trl(args, precompute: bool, checkpointing: bool = True) -> dict:
    import random

    import datasets
    import torch
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    vocab_size = model_config(args.tiny).vocab_size
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="t0", pad_token="t1", eos_token="t2")
    rnd = random.Random(0)
    words = lambda n: " ".join(f"t{rnd.randrange(10, vocab_size)}" for _ in range(n))
    n_words = args.seq // 2 - 1  # TRL appends eos to each completion: 511 + (511 + eos) ~ seq
    data = datasets.Dataset.from_dict({key: [words(n_words) for _ in range(args.pairs)]
                                       for key in ("prompt", "chosen", "rejected")})

    stamps = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            sync(args.device); stamps.append(time.perf_counter())

    precompute_s = []
    original = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **kw):  # TRL runs its reference pass inside the constructor
        sync(args.device); t = time.perf_counter()
        result = original(self, *a, **kw)
        sync(args.device); precompute_s.append(time.perf_counter() - t)
        return result

    DPOTrainer._precompute_ref_logps = timed_precompute
    config = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch, max_length=args.seq + 8,
                       bf16=args.device == "cuda", num_train_epochs=1, logging_steps=20, report_to="none",
                       save_strategy="no", learning_rate=1e-6, dataloader_num_workers=2,
                       precompute_ref_log_probs=precompute, precompute_ref_batch_size=32,
                       gradient_checkpointing=checkpointing,
                       use_cpu=args.device != "cuda")
    reset_peak(args.device)
    sync(args.device); t0 = time.perf_counter()
    # precompute: no reference model in memory (TRL uses the policy before training for the pass)
    trainer = DPOTrainer(model=make_model(args), ref_model=None if precompute else make_model(args).eval(),
                         args=config, train_dataset=data, processing_class=tok)
    sync(args.device); init_s = time.perf_counter() - t0
    trainer.add_callback(StepClock())
    sync(args.device); t1 = time.perf_counter()
    trainer.train()
    sync(args.device); train_s = time.perf_counter() - t1
    steps, tokens_epoch = len(stamps), args.pairs * 2 * args.seq
    skip = min(10, steps // 2)
    steady = (stamps[-1] - stamps[skip - 1]) / (steps - skip)
    ref_s = sum(precompute_s)
    return {"trl_version": trl.__version__, "datasets_version": datasets.__version__, "steps": steps,
            "constructor_s": init_s, "reference_precompute_s": ref_s, "train_s": train_s,
            "epoch_tokens_per_s_train_only": tokens_epoch / train_s,
            "epoch_tokens_per_s_with_ref_pass": tokens_epoch / (train_s + ref_s),
            "epoch_tokens_per_s_trl_scope": tokens_epoch / (train_s + ref_s),
            "steady_step_s": steady, "steady_tokens_per_s": 2 * args.batch * args.seq / steady,
            "peak_gib": peak_gib(args.device)}


# ------------------------------------------------------------------------------------------ driver
def run_part(args) -> None:
    helpers = (peak_gib, reset_peak)
    if args.part.startswith("dpo_"):
        fn = lambda a: train_parts.part_dpo(a, args.part[4:], *helpers)
    elif args.part == "profile_reward_model":
        fn = lambda a: train_parts.part_reward_model(a, *helpers, profile=True)
    elif args.part.startswith("profile_"):
        variant = args.best_variant if args.part == "profile_best" else args.part[8:]
        fn = lambda a: train_parts.part_dpo(a, variant, *helpers, profile=True)
    else:
        fn = {"logprobs": part_logprobs, "prepare": lambda a: train_parts.prepare(a, model_config),
              "reward_model": lambda a: train_parts.part_reward_model(a, *helpers),
              "policy": lambda a: train_parts.part_policy(a, *helpers),
              "trl_precompute": lambda a: part_trl(a, True), "trl_default": lambda a: part_trl(a, False),
              "trl_precompute_nogc": lambda a: part_trl(a, True, checkpointing=False)}[args.part]
    try:
        result = fn(args)
    except Exception as e:
        traceback.print_exc()
        result = {"error": repr(e)[:800]}
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1)


def best_variant(res: dict) -> str:
    """The DPO variant with the highest steady tokens/s so far (baseline when none ran)."""
    scored = [(rec["steady_tokens_per_s"], name[4:]) for name, rec in res.items()
              if name.startswith("dpo_") and isinstance(rec.get("steady_tokens_per_s"), (int, float))]
    return max(scored)[1] if scored else "baseline"


def environment() -> dict:
    import torch
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for name in ("deepspeed", "trl", "datasets", "accelerate"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:
            env[name] = f"unavailable: {e!r}"[:200]
    return env


def summary(res: dict) -> str:
    k = lambda v: f"{v / 1e3:6.1f}k" if isinstance(v, (int, float)) else "   n/a"
    g = lambda v: f"{v:6.1f}" if isinstance(v, (int, float)) else "   n/a"
    lines = ["log-probs fwd+bwd (16x1024x151936 bf16): variant | peak extra GiB | ms | max|diff| vs naive"]
    for name, rec in res.get("logprobs", {}).items():
        if isinstance(rec, dict) and "fwd_bwd_ms_median" in rec:
            lines.append(f"  {name:14s} {g(rec['fwd_bwd_peak_extra_gib'])} {rec['fwd_bwd_ms_median']:8.1f} "
                         f"{rec.get('max_abs_diff_vs_naive', 0.0):.2e}")
    lines.append("DPO: path | steady tok/s | epoch tok/s (ref pass counted) | epoch tok/s (train only) | "
                 "epoch tok/s at TRL's scope (steps + ref pass from a loaded model) | peak GiB")
    for name, rec in res.items():
        if name.startswith(("dpo_", "trl_")) and "steady_tokens_per_s" in rec:
            lines.append(f"  {name:22s} {k(rec['steady_tokens_per_s'])} {k(rec['epoch_tokens_per_s_with_ref_pass'])}"
                         f"  {k(rec['epoch_tokens_per_s_train_only'])} {k(rec.get('epoch_tokens_per_s_trl_scope'))}"
                         f" {g(rec['peak_gib'])}")
    for name in ("reward_model", "policy"):
        if "steady_tokens_per_s" in res.get(name, {}):
            lines.append(f"  {name:22s} {k(res[name]['steady_tokens_per_s'])} steady, peak {g(res[name]['peak_gib'])} GiB")
    for name, rec in res.items():
        if name.startswith("profile_") and "profile" in rec:
            lines.append(f"  {name}: GPU ms/step {rec['profile']['gpu_ms_per_step_total']:.1f} by category "
                         + ", ".join(f"{c} {v:.1f}" for c, v in rec["profile"]["gpu_ms_per_step_by_category"].items()))
    for part, rec in res.items():
        if isinstance(rec, dict) and "error" in rec:
            lines.append(f"  {part} FAILED: {rec['error'][:300]}")
    lines.append(f"anchors (k tokens/s): {ANCHORS_K}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all",) + PARTS, default="all")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help="with --part all: which parts, comma-separated")
    p.add_argument("--profile-steps", type=int, default=10, help="steps inside the torch profile")
    p.add_argument("--resume", action="store_true", help="add to the results of an earlier call on this machine")
    p.add_argument("--best-variant", default="baseline", help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=320, help="pairs per epoch (TRL anchor: 320)")
    p.add_argument("--batch", type=int, default=8, help="pairs per step (rows = 2x)")
    p.add_argument("--seq", type=int, default=1024, help="prompt + completion tokens (half each)")
    p.add_argument("--chunk-sizes", default="1024,4096")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny model/vocab: smoke test on CPU")
    p.add_argument("--part-timeout", type=int, default=240)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.part != "all":
        return run_part(args)

    out_dir = os.environ.get("OUT", "bench/out")
    os.makedirs(out_dir, exist_ok=True)
    res: dict = {"environment": environment(), "argv": sys.argv[1:], "anchors_k_tokens_per_s": ANCHORS_K,
                 "tokens_per_step": 2 * args.batch * args.seq}
    keep = os.path.join(train_parts.WORK, "gpu_bench.json")  # a second call on the same machine continues it
    if args.resume and os.path.exists(keep):
        res = {**json.load(open(keep)), "argv_resumed": sys.argv[1:]}
    print(json.dumps(res["environment"]), flush=True)
    forward = ["--pairs", str(args.pairs), "--batch", str(args.batch), "--seq", str(args.seq), "--reps", str(args.reps),
               "--chunk-sizes", ",".join(map(str, args.chunk_sizes)),
               "--profile-steps", str(args.profile_steps)] + (["--tiny"] if args.tiny else [])
    for part in args.parts.split(","):
        result_file = tempfile.mktemp(suffix=f"-{part}.json")
        extra = ["--best-variant", best_variant(res)]
        t = time.perf_counter()
        try:
            subprocess.run([sys.executable, __file__, *forward, *extra, "--part", part, "--result", result_file],
                           timeout=args.part_timeout, check=False)
            with open(result_file) as f:
                res[part] = json.load(f)
        except Exception as e:
            res[part] = {"error": repr(e)[:500]}
        res[part]["part_wall_s"] = time.perf_counter() - t
        for path in (os.path.join(out_dir, "gpu_bench.json"), keep):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    print(summary(res), flush=True)


if __name__ == "__main__":
    main()
