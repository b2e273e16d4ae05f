"""batchrl's own trainer jobs on the GPU, for bench/bench_gpu_dpo.py (which runs each part in its own
subprocess, next to TRL): the real ``train_dpo`` / ``train_reward_model`` / ``train_policy`` on a
Qwen2-0.5B-shaped model (random weights, word-level tokenizer of 151,936 ids, so every pair is exactly
``seq`` tokens), one DPO run per trainer variant so each change is measured alone, and a torch
profile of the steady DPO step.

Timing: the trainer reads its metrics every ``metrics_every`` steps (one host sync); the ``report``
callback stamps the time at each read, so the steady step = (t[last] - t[first read]) / steps between.
``mean_margin`` (the trainer's before/after metric passes) is timed separately and taken out of the
train-only epoch figure.
"""
from __future__ import annotations

import json
import os
import shutil
import time

WORK = "/tmp/bench_train"
DPO_VARIANTS = {  # cumulative: each adds one change to the one before
    "baseline": dict(fused_logprobs=False, group_by_length=False, metrics_every=1, zero_stage=2, precision="bf16"),
    "fused_logprobs": dict(fused_logprobs=True),
    "no_host_sync": dict(metrics_every=10),
    "zero0": dict(zero_stage=0),
    "bf16_amp": dict(precision="bf16_amp"),
    "compile": dict(torch_compile=True),
    "compile_zero2_bf16": dict(zero_stage=2, precision="bf16"),
}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def variant_config(name: str) -> dict:
    """The cumulative config of variant ``name``; ``<v>_warm`` = v again in a later process (torch.compile's
    inductor/Triton caches and the Triton kernels of the log-prob path are then on disk, as on a retrain)."""
    name = name.removesuffix("_warm")
    cfg: dict = {}
    for key, update in DPO_VARIANTS.items():
        cfg.update(update)
        if key == name:
            return cfg
    raise KeyError(name)


def prepare(args, model_config) -> dict:
    """Model folder (random weights + word-level tokenizer), pairs, reference log-probs (timed, bf16)."""
    import pandas as pd
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from batchrl.training.trainer.reference import compute_reference_logprobs

    os.makedirs(WORK, exist_ok=True)
    cfg = model_config(args.tiny)
    vocab = cfg.vocab_size
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1", eos_token="t2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(f"{WORK}/model")
    tok.save_pretrained(f"{WORK}/model")
    gen = torch.Generator().manual_seed(0)
    text = lambda n: " ".join(f"t{i}" for i in torch.randint(10, vocab, (n,), generator=gen).tolist())
    half = args.seq // 2
    pairs = pd.DataFrame({"id": [str(i) for i in range(args.pairs)],
                          "prompt": [text(half) for _ in range(args.pairs)],
                          "chosen": [text(half - 1) for _ in range(args.pairs)],  # + eos = half tokens
                          "rejected": [text(half - 1) for _ in range(args.pairs)]})
    pairs.to_parquet(f"{WORK}/pairs.parquet")
    out = {}
    # time spent loading the model and tokenising inside the pass, so the pass can also be reported at
    # TRL's scope (its precompute starts from a loaded model and tokenised data)
    from batchrl.training.models import loading
    from batchrl.training.trainer import reference
    setup_s: list[float] = []

    def timed(fn):
        def wrapper(*a, **kw):
            _sync()
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            _sync()
            setup_s.append(time.perf_counter() - t0)
            return result
        return wrapper

    load, encode = loading.load_model_and_tokenizer, reference.encode_pairs
    loading.load_model_and_tokenizer, reference.encode_pairs = timed(load), timed(encode)
    for dtype in ("bfloat16", "float32"):
        setup_s.clear()
        _sync()
        t = time.perf_counter()
        stats = compute_reference_logprobs(f"{WORK}/model", f"{WORK}/pairs.parquet", f"{WORK}/ref_{dtype}.parquet",
                                           max_length=args.seq, batch_size=16, dtype=dtype)
        out[f"reference_pass_{dtype}_s"] = time.perf_counter() - t
        out[f"reference_pass_{dtype}_load_and_tokenise_s"] = sum(setup_s)
        out[f"reference_mean_chosen_len_{dtype}"] = stats["mean_chosen_len"]
    loading.load_model_and_tokenizer, reference.encode_pairs = load, encode
    with open(f"{WORK}/prepare.json", "w") as f:
        json.dump(out, f)
    return out


def _clock(args, profile: bool):
    """A trainer ``report`` callback: a time stamp at each metrics read (a host sync); with ``profile``,
    a torch profile from the first read over the next ``args.profile_steps`` steps."""
    import torch

    stamps: list[tuple[int, float]] = []
    state: dict = {}

    def report(metrics: dict, step: int) -> None:
        stamps.append((step, time.perf_counter()))
        if profile and "prof" not in state:
            from torch.profiler import ProfilerActivity
            state["prof"] = torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["from"] = step
        elif profile and "done" not in state and step >= state["from"] + args.profile_steps:
            _sync()
            state["prof"].__exit__(None, None, None)
            state["done"] = step - state["from"]
    return report, stamps, state


def _fresh(name: str) -> str:
    """An empty output folder (a leftover one would make the trainer resume a finished run)."""
    path = f"{WORK}/{name}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def _steady(stamps, tokens_per_step):
    """Seconds per step between the first and the last metrics read (one read reports several steps:
    each read's time belongs to its last step)."""
    last_step_at = {}
    for step, t in stamps:
        last_step_at[t] = max(step, last_step_at.get(t, step))
    reads = sorted((step, t) for t, step in last_step_at.items())
    (s0, t0), (s1, t1) = reads[0], reads[-1]
    if s1 == s0:
        return float("nan"), float("nan")
    step_s = (t1 - t0) / (s1 - s0)
    return step_s, tokens_per_step / step_s


def part_dpo(args, variant: str, peak_gib, reset_peak, profile: bool = False) -> dict:
    import torch

    from batchrl.training.trainer import dpo
    from batchrl.training.trainer.config import DPOConfig

    prep = json.load(open(f"{WORK}/prepare.json"))
    cfg = DPOConfig(micro_batch_size=args.batch, grad_accum=1, lr=1e-6, max_length=args.seq, epochs=1, beta=0.1,
                    **variant_config(variant))
    margin_s, margin_end = [], []
    timed_margin = dpo.mean_margin

    def margin(*a, **kw):  # the trainer's before/after metric passes: timed, kept out of the train figure
        _sync()
        t = time.perf_counter()
        result = timed_margin(*a, **kw)
        _sync()
        margin_s.append(time.perf_counter() - t)
        margin_end.append(time.perf_counter())
        return result

    dpo.mean_margin = margin
    save_s = []
    timed_save = dpo.TrainLoop.save

    def save(self):  # the final resume checkpoint (weights, fp32 master, optimizer state): timed apart
        _sync()
        t = time.perf_counter()
        path = timed_save(self)
        save_s.append(time.perf_counter() - t)
        return path

    dpo.TrainLoop.save = save
    report, stamps, prof = _clock(args, profile)
    reset_peak(args.device)
    t = time.perf_counter()
    result = dpo.train_dpo(cfg, pairs_parquet=f"{WORK}/pairs.parquet", reference_parquet=f"{WORK}/ref_bfloat16.parquet",
                           model_path=f"{WORK}/model", out_dir=_fresh(f"dpo_{variant}"), report=report)
    job_s = time.perf_counter() - t
    tokens_step = 2 * args.batch * args.seq
    steady_s, steady_tps = _steady(stamps, tokens_step)
    train_s = result["wall_s"] - margin_s[0] - sum(save_s)  # steps only, as TRL's train() with save "no"
    tokens_epoch = args.pairs * 2 * args.seq
    # TRL's scope: its train() starts with tokenised data and a built model and has no margin pass, and its
    # precompute starts from a loaded model: first training step -> last step's metrics read, and the
    # reference pass minus model load and tokenisation
    steps_s = stamps[-1][1] - margin_end[0]
    ref_pass_s = prep["reference_pass_bfloat16_s"] - prep.get("reference_pass_bfloat16_load_and_tokenise_s", 0.0)
    out = {"variant": variant, "config": variant_config(variant), "steps": result["global_step"],
           "steady_step_s": steady_s, "steady_tokens_per_s": steady_tps, "train_loop_s": train_s,
           "epoch_tokens_per_s_train_only": tokens_epoch / train_s,
           "epoch_tokens_per_s_with_ref_pass": tokens_epoch / (train_s + prep["reference_pass_bfloat16_s"]),
           "epoch_steps_s": steps_s, "epoch_tokens_per_s_steps_only": tokens_epoch / steps_s,
           "epoch_tokens_per_s_trl_scope": tokens_epoch / (steps_s + ref_pass_s),
           "margin_pass_s": margin_s, "checkpoint_save_s": save_s, "job_s_incl_load_init_export": job_s,
           # [step, seconds after the loop started] of the first metrics read
           "first_read": [stamps[0][0], stamps[0][1] - margin_end[0]] if stamps else None,
           "peak_gib": peak_gib(args.device),
           "final_loss": result["final"].get("loss")}
    if "done" in prof:  # the profiled steps run slower: this part's timings are not the variant's figures
        out["profile"] = profile_breakdown(prof["prof"], prof["done"], os.environ.get("OUT", "/tmp"), variant)
    return out


def profile_breakdown(prof, steps: int, out_dir: str, variant: str) -> dict:
    """GPU kernel time per category and per trainer phase (record_function scopes), per step."""
    events = prof.key_averages()
    cats = {"matmul (cuBLAS/cutlass)": ("gemm", "cutlass", "nvjet", "xmma", "sm90", "matmul"),
            "attention": ("flash", "fmha", "attention", "efficient"),
            "triton log-prob kernels": ("forward_rows", "backward_rows"),
            "triton (compiled)": ("triton_",),
            "optimizer": ("multi_tensor", "adam", "foreach"),
            "copies / casts": ("copy", "memcpy", "memset", "cast"),
            "reductions": ("reduce",),
            "elementwise": ("elementwise", "vectorized", "unrolled")}
    by_cat: dict[str, float] = {}
    kernels = []
    for ev in events:
        dev_us = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
        # kernels only (an aten op's self device time repeats its kernels'; annotations span them)
        if dev_us <= 0 or "CUDA" not in str(ev.device_type) or ev.key.startswith(("batchrl/", "aten::")):
            continue
        name = ev.key.lower()
        cat = next((c for c, keys in cats.items() if any(k in name for k in keys)), "other")
        by_cat[cat] = by_cat.get(cat, 0.0) + dev_us / 1e3 / steps
        kernels.append((ev.key[:90], dev_us / 1e3 / steps, ev.count // max(1, steps)))
    phases = {ev.key: {"cpu_ms_per_step": ev.cpu_time_total / 1e3 / steps,
                       "device_ms_per_step": (getattr(ev, "device_time_total", 0) or 0) / 1e3 / steps}
              for ev in events if ev.key.startswith("batchrl/")}
    table = events.table(sort_by="self_cuda_time_total", row_limit=40)
    with open(os.path.join(out_dir, f"dpo_profile_{variant}.txt"), "w") as f:
        f.write(table)
    kernels.sort(key=lambda k: -k[1])
    return {"steps": steps, "gpu_ms_per_step_by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "gpu_ms_per_step_total": sum(by_cat.values()), "phases": phases, "top_kernels_ms_per_step": kernels[:25]}


def part_reward_model(args, peak_gib, reset_peak, profile: bool = False) -> dict:
    from batchrl.training.trainer.config import RewardModelConfig
    from batchrl.training.trainer.reward import train_reward_model

    cfg = RewardModelConfig(micro_batch_size=args.batch, lr=1e-6, max_length=args.seq, epochs=1,
                            **{k: v for k, v in variant_config(args.best_variant).items() if k != "fused_logprobs"})
    report, stamps, prof = _clock(args, profile)
    reset_peak(args.device)
    result = train_reward_model(cfg, pairs_parquet=f"{WORK}/pairs.parquet", model_path=f"{WORK}/model",
                                out_dir=_fresh("rm"), report=report)
    steady_s, steady_tps = _steady(stamps, 2 * args.batch * args.seq)
    out = {"config": cfg.model_dump(include={"zero_stage", "precision", "torch_compile", "metrics_every"}),
           "steps": result["global_step"], "steady_step_s": steady_s, "steady_tokens_per_s": steady_tps,
           "peak_gib": peak_gib(args.device), "accuracy_after": result.get("train_accuracy_after")}
    if "done" in prof:  # as part_dpo's: the profiled steps' timings are not the figures
        out["profile"] = profile_breakdown(prof["prof"], prof["done"], os.environ.get("OUT", "/tmp"), "reward_model")
    return out


def part_policy(args, peak_gib, reset_peak) -> dict:
    """GRPO-style update on 2 x pairs rows of seq tokens (half prompt, half response), random advantages;
    the old/reference log-prob passes are inside the job and included in job_s."""
    import numpy as np
    import pandas as pd

    from batchrl.training.trainer.config import PolicyConfig
    from batchrl.training.trainer.policy import train_policy

    rng = np.random.default_rng(0)
    vocab, half, rows = 1024 if args.tiny else 151936, args.seq // 2, 2 * args.pairs
    batch = pd.DataFrame({"prompt_ids": [rng.integers(10, vocab, half).tolist() for _ in range(rows)],
                          "response_ids": [rng.integers(10, vocab, half).tolist() for _ in range(rows)],
                          "advantages": [np.full(half, rng.normal(), dtype=np.float32).tolist() for _ in range(rows)]})
    batch.to_parquet(f"{WORK}/policy_batch.parquet")
    best = {k: v for k, v in variant_config(args.best_variant).items() if k != "group_by_length"}
    cfg = PolicyConfig(micro_batch_size=2 * args.batch, lr=1e-6, max_length=args.seq, kl_loss_coef=0.01, **best)
    report, stamps, _ = _clock(args, False)
    reset_peak(args.device)
    t = time.perf_counter()
    result = train_policy(cfg, batch_parquet=f"{WORK}/policy_batch.parquet", model_path=f"{WORK}/model",
                          out_dir=_fresh("policy"), reference_model_path=f"{WORK}/model", report=report)
    steady_s, steady_tps = _steady(stamps, 2 * args.batch * args.seq)
    return {"config": best, "steps": result["global_step"], "steady_step_s": steady_s,
            "steady_tokens_per_s": steady_tps, "job_s": time.perf_counter() - t, "peak_gib": peak_gib(args.device)}
