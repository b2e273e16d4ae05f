"""What a batch of a shape not seen before costs in attention, per SDPA backend choice (GPU).

    python3 bench/bench_sdpa_shapes.py --out FILE.json [--layers 24]

batchrl's jobs run right-padded batches whose (rows, padded length) change from batch to batch (length-sorted
batches of pairs and samples). On Hopper with a recent cuDNN, torch tries cuDNN attention first for a masked
``scaled_dot_product_attention``; cuDNN builds an execution plan for every new shape. For each mode (a fresh
process each: torch reads ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` once) this times, on the Qwen2-0.5B shape with
random weights: a forward of 8 batches of new shapes, then the same 8 again (cached), and forward + backward of 8
more new shapes; and it names the attention kernels one forward ran (torch profiler).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {
    "default": {},
    "cudnn_deprioritized_env": {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"},
    "cudnn_disabled": {"BENCH_DISABLE_CUDNN_SDP": "1"},
}


def padded_batch(rows: int, width: int, vocab: int, device):
    """Right-padded random ids with row lengths spread over [width/2, width] (the longest = width)."""
    import torch

    ids = torch.randint(10, vocab, (rows, width), device=device)
    lengths = torch.linspace(width // 2, width, rows, device=device).long()
    mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def one_mode(layers: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from qwen_shape import QWEN2_05B

    if os.environ.get("BENCH_DISABLE_CUDNN_SDP") == "1":
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device("cuda")
    config = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    vocab = config.vocab_size

    def timed(shapes, backward: bool) -> list[float]:
        out = []
        for rows, width in shapes:
            ids, mask = padded_batch(rows, width, vocab, device)
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.set_grad_enabled(backward):
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                if backward:
                    hidden.float().pow(2).mean().backward()
            torch.cuda.synchronize()
            out.append(round(time.perf_counter() - started, 4))
        return out

    timed([(8, 32)], backward=True)  # CUDA context, cuBLAS handles, allocator: not what is measured
    forward_shapes = [(64, 40 + 8 * k) for k in range(8)]
    train_shapes = [(32, 44 + 8 * k) for k in range(8)]
    result = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "gpu": torch.cuda.get_device_name(), "layers": layers,
              "forward_new_shapes_s": timed(forward_shapes, backward=False),
              "forward_same_shapes_again_s": timed(forward_shapes, backward=False),
              "train_step_new_shapes_s": timed(train_shapes, backward=True)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed([(16, 100)], backward=False)
    names = {e.name for e in prof.events() if any(k in e.name.lower() for k in ("fmha", "flash", "cudnn", "attention", "sdpa"))}
    result["attention_kernels"] = sorted(names)[:6]
    for key in ("forward_new_shapes_s", "forward_same_shapes_again_s", "train_step_new_shapes_s"):
        result[key[:-2] + "_total_s"] = round(sum(result[key]), 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one_mode(a.layers)))
        return
    report = {}
    for mode, env in MODES.items():
        proc = subprocess.run([sys.executable, __file__, "--out", a.out, "--layers", str(a.layers), "--child"],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        report[mode] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
            {"error": proc.stderr[-2000:]}
        print(mode, json.dumps({k: v for k, v in report[mode].items() if k.endswith("total_s") or k in
                                ("attention_kernels", "cudnn", "error")}), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:  # after each mode: a run cut short keeps the modes before
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
