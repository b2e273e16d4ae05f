"""Packed vs padded micro-batches on the GPU, at the RL-vs-TRL bench's shape: SmolLM2-135M-Instruct (the bench's
base folder), the real task's prompts with the chat template, 64 rollouts a micro-batch whose answers are as the
six-minute run measured them (mean ~25 tokens, 13.5% cut at 96). Checks that the two layouts give the same
completion log-probs on the GPU (bf16 autocast and fp32: the packed-sequence mask is transformers' path, whose
version differs here from the dev box's), then times 24 optimiser steps (forward, backward, fused AdamW) of each
layout, eager and with the decoder layers compiled (``torch_compile: true``). Prints and writes one JSON object.

    python3 bench/check_packing_gpu.py --out $OUT   # on the device (gpu env), after `source bench/device_env.sh`
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")


def rollout_rows(tokenizer, vocab: int, n: int = 1536, seed: int = 0) -> tuple[list, list]:
    import numpy as np

    from batchrl.training.data.text import encode_prompts

    rows = [json.loads(line) for line in open(os.path.join(REPO, "sample_data/real/train.jsonl"))]
    prompts = encode_prompts(tokenizer, [rows[i % len(rows)]["prompt"] for i in range(n // 8) for _ in range(8)])
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.135, 96, rng.integers(6, 30, n))
    return prompts, [rng.integers(100, vocab - 1, k).tolist() for k in lengths]


def timed_steps(model, optimizer, prompts, completions, layout, steps: int) -> float:
    import torch

    from batchrl.training.data.batch_layout import completion_logprobs, to_device

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    for step in range(steps):
        idx = range(step * 64, (step + 1) * 64)
        batch = to_device(layout([prompts[i] for i in idx], [completions[i] for i in idx], 0), DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logp, entropy = completion_logprobs(model, batch, with_entropy=True)
            mask = batch["response_mask"]
            loss = -(logp * mask).sum() / mask.sum() - 0.0 * (entropy * mask).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - started


def main() -> None:
    import torch

    from bench_gpu_rl_vs_trl import prepare_base
    from batchrl.training.data.batch_layout import completion_logprobs, pad_prompt_completion, to_device
    from batchrl.training.data.packing import pack_prompt_completion
    from batchrl.training.models.loading import load_model_and_tokenizer
    from batchrl.training.trainer.loop import compile_layers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", default="/tmp/rl_vs_trl")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--base", help="a model folder instead of the bench's base (a CPU check of this script)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    record_path = os.path.join(args.state, "record.json")
    record = json.load(open(record_path)) if os.path.exists(record_path) else {}
    base = args.base or record.get("arms", {}).get("full", {}).get("base") or prepare_base(args.state, args.out)
    import transformers

    result: dict = {"base": base, "transformers": transformers.__version__, "torch": torch.__version__}
    layouts = {"padded": pad_prompt_completion, "packed": pack_prompt_completion}

    model, tokenizer = load_model_and_tokenizer(base, device=DEVICE)
    prompts, completions = rollout_rows(tokenizer, model.config.vocab_size)
    real = sum(len(p) + len(c) for p, c in zip(prompts[:64], completions[:64]))
    result["tokens_first_micro_batch"] = {
        "real": real, **{name: int(layout(prompts[:64], completions[:64], 0)["input_ids"].numel())
                         for name, layout in layouts.items()}}
    with torch.no_grad():  # the same log-probs both ways, in fp32 and under bf16 autocast
        for precision in ("fp32", "bf16_amp"):
            values = {}
            for name, layout in layouts.items():
                batch = to_device(layout(prompts[:64], completions[:64], 0), DEVICE)
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=precision == "bf16_amp"):
                    values[name] = completion_logprobs(model, batch).float()
            mask = batch["response_mask"] > 0
            gap = (values["packed"] - values["padded"]).abs()[mask]
            result[f"logprob_gap_{precision}"] = {"max": gap.max().item(), "mean": gap.mean().item(),
                                                   "mean_logprob": values["padded"][mask].mean().item()}
    for compiled in (False, True):
        for name, layout in layouts.items():
            model, _ = load_model_and_tokenizer(base, device=DEVICE)
            model.train()
            if compiled:
                compile_layers(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=DEVICE == "cuda")
            first = timed_steps(model, optimizer, prompts, completions, layout, 4)  # warm-up (and compiles)
            steady = timed_steps(model, optimizer, prompts, completions, layout, args.steps)
            key = f"{name}{'_compiled' if compiled else ''}"
            result[key] = {"first_4_steps_s": round(first, 3), f"{args.steps}_steps_s": round(steady, 3)}
            print(key, result[key], flush=True)
            del model, optimizer
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(result, indent=1))
    with open(os.path.join(args.out, "packing_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
