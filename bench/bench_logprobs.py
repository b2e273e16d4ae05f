"""Peak memory and time of token log-probs: naive full-logits path vs chunked LM-head path.

Each variant runs in its own subprocess so that peak RSS belongs to that variant alone; the
kernel's peak mark is reset once the inputs exist (/proc/self/clear_refs), and "extra peak" =
peak RSS (VmHWM) - RSS at that point (weights, hidden states, labels already allocated).
On CUDA (``--device cuda``) the same is done with torch.cuda.max_memory_allocated.

    .venv/bin/python bench/bench_logprobs.py                      # vocab 151936, seq 1024, batch 2
    .venv/bin/python bench/bench_logprobs.py --batch 1 --chunk-size 128
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("naive", "chunked")
MODES = ("forward", "forward+backward")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) so that input creation does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then VmHWM / ru_maxrss include input creation: extra peak is an upper bound


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args) -> None:
    import torch

    from batchrl.training.algos import token_logprobs_from_hidden, token_logprobs_from_logits

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backward = args.mode == "forward+backward"
    hidden = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=dtype)
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype).div_(args.hidden**0.5)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    hidden.requires_grad_(backward), weight.requires_grad_(backward)

    def run():
        hidden.grad = weight.grad = None
        with torch.set_grad_enabled(backward):
            if args.variant == "naive":
                logprobs = token_logprobs_from_logits(hidden @ weight.t(), labels)
            else:
                logprobs = token_logprobs_from_hidden(hidden, weight, labels, chunk_size=args.chunk_size)
            if backward:
                logprobs.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return logprobs.detach()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _rss_bytes()
    start = time.perf_counter()
    logprobs = run()
    first_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()
    times = [first_s]
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    result = {"extra_peak_mib": (peak - base) / 2**20, "peak_mib": peak / 2**20, "base_mib": base / 2**20,
              "median_s": statistics.median(times[1:] if len(times) > 1 else times), "first_s": first_s}
    torch.save({"logprobs": logprobs.cpu(), "grad_hidden": None if hidden.grad is None else hidden.grad.cpu()},
               args.out)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896)  # Qwen2-0.5B
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen2 vocabulary
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import torch

    print(f"batch={args.batch} seq={args.seq} hidden={args.hidden} vocab={args.vocab} "
          f"chunk_size={args.chunk_size} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()}")
    print(f"{'mode':<17} {'variant':<8} {'extra peak MiB':>15} {'peak MiB':>9} {'median s':>9} {'first s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            outputs = {}
            for variant in VARIANTS:
                out = os.path.join(tmp, f"{variant}.pt")
                cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--mode", mode, "--out", out]
                for name in ("batch", "seq", "hidden", "vocab", "chunk_size", "dtype", "device", "repeats"):
                    cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{variant}/{mode} failed:\n{proc.stderr}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                outputs[variant] = (r, torch.load(out))
                print(f"{mode:<17} {variant:<8} {r['extra_peak_mib']:>15.0f} {r['peak_mib']:>9.0f} "
                      f"{r['median_s']:>9.3f} {r['first_s']:>8.3f}", flush=True)
            (naive, naive_t), (chunked, chunked_t) = outputs["naive"], outputs["chunked"]
            diff = (naive_t["logprobs"] - chunked_t["logprobs"]).abs().max().item()
            line = f"  -> extra-peak ratio chunked/naive = {chunked['extra_peak_mib'] / naive['extra_peak_mib']:.3f}, "
            line += f"max |logprob diff| = {diff:.2e}"
            if naive_t["grad_hidden"] is not None:
                gdiff = (naive_t["grad_hidden"] - chunked_t["grad_hidden"]).abs().max().item()
                line += f", max |grad_hidden diff| = {gdiff:.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
