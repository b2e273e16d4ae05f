"""The ``dpo_ref_profile`` part of bench/bench_gpu_scale.py: batchrl's DPO reference pass at a real model's shape,
taken apart (run there: ``--parts shape_7b,dpo_prepare,dpo_ref_profile``)."""
from __future__ import annotations

import os
import tempfile
import time

import bench_gpu_dpo as dpo_bench
import bench_gpu_train as train_parts  # WORK: dpo_prepare's model folder and pairs


def part_dpo_ref_profile(args) -> dict:
    """Where batchrl's DPO reference pass spends its time at the shape (dpo_prepare's model folder and pairs):
    the pass as the job runs it, cold (fresh Triton cache, first CUDA use in this process) and again warm, with
    its phases; then, on one loaded model and the same pre-built batches, the pass's pieces timed apart
    (decoder with and without the padding mask and position ids, the fused LM head + log-softmax, the naive
    logits path) beside a plain bf16 ``model(input_ids)`` forward; torch.profiler's top kernels of each."""
    work, model_dir = train_parts.WORK, os.path.join(train_parts.WORK, "model")
    pairs_file = os.path.join(work, "pairs.parquet")
    if not os.path.exists(pairs_file):
        return {"error": "no pairs: run the dpo_prepare part first (same --work)"}
    triton_cold = tempfile.mkdtemp(prefix="triton-cold-")
    os.environ["TRITON_CACHE_DIR"] = triton_cold  # the cold pass compiles the fused kernels as a fresh job would
    import pandas as pd
    import torch

    from batchrl.training.timing import phases

    from batchrl.training.timing import profiling
    from batchrl.training.algos import token_logprobs_from_hidden
    from batchrl.training.models.loading import load_model_and_tokenizer
    from batchrl.training.trainer import reference
    from batchrl.training.trainer.batching import (FUSED_CHUNK_ROWS, completion_logprobs, encode_pairs,
                                                   fused_lm_head, length_sorted_batches, pair_batch, to_device)
    from batchrl.training.trainer.reference import pair_logprobs

    sync = train_parts._sync
    out: dict = {"pairs": args.pairs, "seq": args.seq, "ref_batch_pairs": args.ref_batch}
    for name in ("cold", "warm"):  # the job's whole pass: load + tokenise beside it, then the log-probs
        dpo_bench.reset_peak(args.device)
        with phases.recording() as clock:
            sync(); t = time.perf_counter()
            reference.compute_reference_logprobs(model_dir, pairs_file, os.path.join(work, f"ref_{name}.parquet"),
                                                 max_length=args.seq, batch_size=args.ref_batch, dtype="bfloat16")
            sync(); wall = time.perf_counter() - t
        out[f"pass_{name}"] = {"wall_s": round(wall, 3), "phases_s": clock.summary(),
                               "peak_gib": dpo_bench.peak_gib(args.device)}
        torch.cuda.empty_cache() if args.device == "cuda" else None

    model, tok = load_model_and_tokenizer(model_dir, dtype="bfloat16", device=args.device)
    items = encode_pairs(tok, pd.read_parquet(pairs_file).to_dict("records"), args.seq)
    lengths = [2 * (len(it["chosen_prompt"]) + max(len(it["chosen"]), len(it["rejected"]))) for it in items]
    batches = [to_device(pair_batch([items[i] for i in idx], tok.pad_token_id), args.device)
               for idx in length_sorted_batches(lengths, args.ref_batch, None)]
    tokens = sum(b["input_ids"].numel() for b in batches)
    out.update(batch_shapes=[list(b["input_ids"].shape) for b in batches], tokens=tokens,
               attention_mask_all_ones=all(bool(b["attention_mask"].all()) for b in batches),
               attn_implementation=getattr(model.config, "_attn_implementation", None),
               model_dtype=str(next(model.parameters()).dtype))
    decoder, head_weight = fused_lm_head(model)
    hidden = []

    def each(fn):  # one batch's output is dropped before the next (full logits: 10 GB a batch at the 7B shape)
        for b in batches:
            fn(b)

    def decoder_masked():
        hidden.clear()
        for b in batches:
            hidden.append(decoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                  position_ids=b["position_ids"], use_cache=False).last_hidden_state)

    def fused_head_only():
        for b, h in zip(batches, hidden):
            R = b["responses"].shape[1]
            labels = b["responses"].masked_fill(b["response_mask"] == 0, -100)
            token_logprobs_from_hidden(h[:, -R - 1:-1], head_weight, labels, chunk_size=FUSED_CHUNK_ROWS)

    variants = {  # each over all batches of the pass (64 pairs = 4 batches of 32 rows x 1,024 tokens by default)
        "pair_logprobs (the job's pass, host padding included)":
            lambda: pair_logprobs(model, items, tok.pad_token_id, args.device, batch_size=args.ref_batch),
        "completion_logprobs fused": lambda: each(lambda b: completion_logprobs(model, b)),
        "completion_logprobs naive (logits, float32 log-softmax)":
            lambda: each(lambda b: completion_logprobs(model, b, fused=False)),
        "decoder + mask + position_ids": decoder_masked,
        "fused LM head + log-softmax only": fused_head_only,
        "decoder(input_ids) plain": lambda: each(lambda b: decoder(input_ids=b["input_ids"], use_cache=False)),
        "model(input_ids) plain bf16 forward (full logits)":
            lambda: each(lambda b: model(input_ids=b["input_ids"], use_cache=False)),
    }
    timings = {}
    with torch.no_grad():
        for name, fn in variants.items():
            runs = []
            for _ in range(3):  # the first is a warm-up
                sync(); t = time.perf_counter()
                fn()
                sync(); runs.append(time.perf_counter() - t)
            best = min(runs[1:])
            timings[name] = {"first_s": round(runs[0], 4), "warm_s": round(best, 4),
                             "tokens_per_s": round(tokens / best)}
            if args.device == "cuda":
                torch.cuda.empty_cache()
        out["timings"] = timings
        profiles = {}
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        # on CPU (smoke test) the summaries have no kernels
        for name in ("completion_logprobs fused", "decoder + mask + position_ids", "decoder(input_ids) plain",
                     "fused LM head + log-softmax only", "model(input_ids) plain bf16 forward (full logits)"):
            if name == "fused LM head + log-softmax only":
                decoder_masked()
            with profile(activities=activities) as prof:
                variants[name]()
                sync()
            trace = tempfile.mktemp(suffix=".json")
            prof.export_chrome_trace(trace)
            with open(trace) as f:
                s = profiling.summarize(json.load(f).get("traceEvents", []), top=12)
            os.unlink(trace)
            profiles[name] = {k: s[k] for k in ("wall_s", "gpu_busy_s", "gpu_busy_pct", "kernels")}
            profiles[name]["gaps_top3"] = s["gaps"][:3]
        out["profiles"] = profiles
    pr = out["pass_cold"]["phases_s"], out["pass_warm"]["phases_s"]
    out["reading"] = {
        "cold_logprobs_s": pr[0].get("logprobs"), "warm_logprobs_s": pr[1].get("logprobs"),
        "first_call_cost_s": round((pr[0].get("logprobs") or 0) - (pr[1].get("logprobs") or 0), 3),
        "warm_pass_tokens_per_s": round(tokens / pr[1]["logprobs"]) if pr[1].get("logprobs") else None,
        "plain_forward_tokens_per_s": timings["model(input_ids) plain bf16 forward (full logits)"]["tokens_per_s"]}
    return out
