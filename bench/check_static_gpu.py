"""GPU check of the static-cache engine (run on the device before the benchmarks):
CUDA-graph replay gives the same samples as eager decoding for the same seed, and its greedy
continuation equals plain ``generate`` in bf16 (same tokens for most rows: bf16 ties may differ) —
with cuDNN attention allowed (torch's choice on Hopper) and off (the jobs' default, ``BATCHRL_CUDNN_ATTENTION``).

    python3 bench/check_static_gpu.py MODEL_DIR
"""
import json
import sys
import time

import torch

from batchrl.training.rollout import make_rollout_engine

PROMPTS = ["What is 2 + 3? Answer with a number.", "Name the capital of France.", "Count to five.", "Hello!"]


def run(kind: str, model: str, **kw) -> tuple[list, float]:
    engine = make_rollout_engine(kind, model_path=model, max_new_tokens=48, batch_size=8, device="cuda",
                                 dtype="bfloat16", **kw)
    engine.generate(PROMPTS[:1], n=1, seed=0)  # warm-up (and graph capture)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = engine.generate(PROMPTS, n=2, seed=1)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def check(model: str) -> dict:
    graphs, t_graphs = run("static", model)
    eager, t_eager = run("static", model, cuda_graphs=False)
    same = [a["response_ids"] == b["response_ids"] for a, b in zip(graphs, eager)]
    greedy_static, _ = run("static", model, temperature=0.0)
    greedy_plain, _ = run("transformers", model, temperature=0.0)
    agree = [a["response_ids"] == b["response_ids"] for a, b in zip(greedy_static, greedy_plain)]
    return {"graphs_equal_eager_rows": f"{sum(same)}/{len(same)}", "graphs_s": round(t_graphs, 3),
            "eager_s": round(t_eager, 3), "greedy_equal_plain_generate_rows": f"{sum(agree)}/{len(agree)}",
            "example": graphs[0]["response"][:120]}


if __name__ == "__main__":
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        print(json.dumps({"cudnn_attention": cudnn, **check(sys.argv[1])}), flush=True)
