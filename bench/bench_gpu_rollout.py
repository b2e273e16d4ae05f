"""Rollout engines side by side on one GPU, in one process: plain Hugging Face ``generate``, batchrl's
static-cache engine (CUDA graphs) and vLLM (through batchrl's vLLM engine); each held to the
RolloutEngine contract on chat prompts, and the log-probs each reports against a recompute.

    python3 bench/bench_gpu_rollout.py --model HF_FOLDER [--label smollm2] [--batch 256]
        [--prompt-tokens 128] [--new-tokens 256] [--contract-tokens 64] [--gpu-mem 0.5] [--no-vllm] --out DIR

On the device, once the `graph` and `vllm` carry bundles are assembled (bench/carry.py):
    mkdir -p /tmp/pkgroot && ln -sfn "$PWD" /tmp/pkgroot/batchrl
    export PYTHONPATH=/tmp/pkgroot:/tmp/carry/vllm/site:/tmp/carry/graph/site

Same settings for all: `batch` prompts of exactly `prompt-tokens` seeded random token ids (no special
tokens) given as ids; T=1, top_p=1, top_k=0, n=1, exactly `new-tokens` new tokens (eos ignored).
Stages, each guarded (a failure is recorded, the rest still run):
  hf        bf16 generate, timed without and with log-probs (output_logits + log_softmax gather); then the
            cost of recomputing the sampled tokens' log-probs in one bf16 forward pass (what the trainer's
            old_logprobs="recompute" pays instead of asking the engine).
  static    make_rollout_engine("static") in bf16, batch = `batch` rows in one chunk: first call (graph
            capture), steady call with CUDA graphs, and one eager call (graphs off); log-probs always on.
            Then its contract on chat prompts.
  vllm      make_rollout_engine("vllm") (cold start timed; one retry with enforce_eager if compiled mode
            fails), then engine.llm.generate: (a) no log-probs, (b) logprobs=0, both one seed per prompt as
            rollouts use, (c) = (a) unseeded (vLLM samples seeded requests one by one). Then its contract.
  contract  engine.generate(4 chat prompts, n=4, seed=0) twice and seed=1 once: fields, order, finish
            reasons, same seed -> same samples; log-probs recomputed by the HF model in float32 and bf16.
Writes DIR/rollout_<label>.json and prints a summary."""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from collections import Counter

# We never filter (top-k/top-p), the one case FlashInfer's sampler handles: off, vLLM needn't import flashinfer.
for key, value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(key, value)
PROMPTS = ["What is 2 + 3? Answer with a number.", "Name the capital of France in one word.",
           "Tom has 3 boxes with 6 pens each. How many pens does he have? Answer with a number.",
           "Write one short sentence about the sea."]


def guarded(box: dict, name: str, fn) -> None:
    """Run one stage; its result (a dict) or its error lands in box[name]."""
    start = time.perf_counter()
    try:
        box[name] = fn()
    except Exception as exc:  # noqa: BLE001 - record the failure and go on
        traceback.print_exc()
        box[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    box[name]["stage_s"] = round(time.perf_counter() - start, 2)
    print(f"== {name}: {json.dumps(box[name], default=str)[:3000]}", flush=True)


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def hf_stage(a, prompts: list[list[int]], pad_id: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    ids, n = torch.tensor(prompts, device="cuda"), a.new_tokens
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad_id, return_dict_in_generate=True)
    out = {"dtype": "bfloat16", "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    with torch.no_grad():
        model.generate(ids[:8], attention_mask=torch.ones_like(ids[:8]), max_new_tokens=4, **kw)  # warm-up
        for name, with_lp in (("no_logprobs", False), ("logprobs", True)):
            torch.manual_seed(a.seed)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            res = model.generate(ids, attention_mask=torch.ones_like(ids), min_new_tokens=n, max_new_tokens=n,
                                 output_logits=with_lp, **kw)
            new = res.sequences[:, ids.shape[1]:]
            if with_lp:  # one [B, V] float32 tensor per step: gather step by step, no [B, N, V] copy
                lp = torch.stack([torch.log_softmax(x.float(), -1).gather(-1, new[:, i:i + 1]).squeeze(-1)
                                  for i, x in enumerate(res.logits)], dim=1)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            out[name] = {"s": round(dt, 3), "tokens_per_s": round(new.numel() / dt, 1),
                         "all_full_length": new.shape[1] == n,
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            if with_lp:
                out[name]["mean_logprob"] = round(lp.mean().item(), 4)
                del lp
            del res, new
        out["recompute_logprobs"] = recompute_cost(model, ids, n)
    del model
    free_cuda()
    return out


def recompute_cost(model, prompts, new_tokens: int, micro_batch: int = 32) -> dict:
    """One bf16 forward over prompt + `new_tokens` sampled-like tokens per row, log-probs of the latter."""
    import torch

    seqs = torch.cat([prompts, torch.randint_like(prompts[:, :1].expand(-1, new_tokens), 0, 1000)], dim=1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, len(seqs), micro_batch):
        chunk = seqs[i:i + micro_batch]
        logits = model(chunk).logits[:, prompts.shape[1] - 1:-1].float()
        (logits.gather(-1, chunk[:, prompts.shape[1]:, None]).squeeze(-1) - logits.logsumexp(-1)).sum().item()
        del logits
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {"s": round(dt, 3), "tokens_per_s": round(len(seqs) * new_tokens / dt, 1), "micro_batch": micro_batch}


def static_stage(a, prompts: list[list[int]], box: dict) -> dict:
    import torch
    from batchrl.training.rollout import make_rollout_engine

    engine = make_rollout_engine("static", model_path=a.model, max_new_tokens=a.new_tokens, batch_size=a.batch,
                                 device="cuda", dtype="bfloat16")
    engine.stop_ids = set()  # exactly new_tokens per row, like the other contenders (eos ignored)
    out = {"dtype": "bfloat16", "batch_size": a.batch}

    def timed(seed: int) -> dict:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        rows = engine._generate_chunk(prompts, seed)  # one chunk: the engine's unit of work
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tokens = sum(len(r[0]) for r in rows)
        lps = [x for r in rows for x in r[1]]
        return {"s": round(dt, 3), "tokens_per_s": round(tokens / dt, 1), "all_full_length": tokens == a.batch * a.new_tokens,
                "mean_logprob": round(sum(lps) / len(lps), 4), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}

    out["first_call_with_capture"] = timed(a.seed)
    out["cuda_graphs"] = timed(a.seed + 1)
    out["cuda_graphs_same_seed_repeats"] = timed(a.seed + 1)["mean_logprob"] == out["cuda_graphs"]["mean_logprob"]
    engine.cuda_graphs, engine._decoders = False, {}
    out["eager"] = timed(a.seed + 1)
    del engine
    free_cuda()
    contract_engine = make_rollout_engine("static", model_path=a.model, max_new_tokens=a.contract_tokens,
                                          batch_size=16, device="cuda", dtype="bfloat16")
    guarded(box, "static_contract", lambda: contract_stage(a, contract_engine))
    del contract_engine
    free_cuda()
    return out


def vllm_start(a, state: dict) -> dict:
    t = time.perf_counter()
    import vllm
    from batchrl.training.rollout import make_rollout_engine

    out = {"vllm_version": vllm.__version__, "import_s": round(time.perf_counter() - t, 2),
           "gpu_memory_utilization": a.gpu_mem, "errors": []}
    for eager in [True] if a.enforce_eager else [False, True]:
        t = time.perf_counter()
        try:
            state["engine"] = make_rollout_engine("vllm", model_path=a.model, max_new_tokens=a.contract_tokens,
                                                  gpu_memory_utilization=a.gpu_mem, enforce_eager=eager)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out["errors"].append(f"enforce_eager={eager}: {type(exc).__name__}: {exc}"[:1000])
            free_cuda()
            continue
        mc = getattr(state["engine"].llm.llm_engine, "model_config", None)
        out.update(cold_start_s=round(time.perf_counter() - t, 2), enforce_eager=eager,
                   dtype=str(getattr(mc, "dtype", "?")), max_model_len=getattr(mc, "max_model_len", None),
                   logprobs_mode=str(getattr(mc, "logprobs_mode", "?")))
        return out
    raise RuntimeError("vLLM engine did not start: " + " | ".join(out["errors"]))


def vllm_run(a, llm, prompts: list[list[int]], logprobs: int | None, seeded: bool, tokens: int) -> dict:
    from vllm import SamplingParams

    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=tokens, min_tokens=tokens,
                             ignore_eos=True, seed=a.seed + i if seeded else None, logprobs=logprobs)
              for i in range(len(prompts))]
    llm.reset_prefix_cache()  # the same prompts run three times: no prefill for free
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    lens = [len(r.outputs[0].token_ids) for r in res]
    out = {"s": round(dt, 3), "tokens_per_s": round(sum(lens) / dt, 1), "all_full_length": set(lens) == {tokens}}
    if logprobs is not None:
        got = [c.logprobs[i][tok].logprob for r in res for c in r.outputs for i, tok in enumerate(c.token_ids)]
        out.update(logprobs_per_token_ok=len(got) == sum(lens), mean_logprob=round(sum(got) / len(got), 4))
    return out


def contract_stage(a, engine) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    P, n = len(PROMPTS), 4
    s1, s2, s3 = (engine.generate(PROMPTS, n=n, seed=seed) for seed in (0, 0, 1))
    ids = lambda ss: [s["response_ids"] for s in ss]  # noqa: E731
    fields = {"prompt_index", "sample_index", "prompt", "response", "prompt_ids", "response_ids", "rollout_logprobs",
              "finish_reason"}
    same = [abs(x - y) for u, v in zip(s1, s2) if u["response_ids"] == v["response_ids"]
            for x, y in zip(u["rollout_logprobs"], v["rollout_logprobs"])]
    out = {
        "count_ok": len(s1) == P * n, "fields_ok": all(fields <= set(s) for s in s1),
        "order_ok": [(s["prompt_index"], s["sample_index"]) for s in s1] == [divmod(i, n) for i in range(P * n)],
        "lengths_ok": all(len(s["response_ids"]) == len(s["rollout_logprobs"]) > 0 for s in s1),
        "finish_ok": all(s["finish_reason"] in ("stop", "length") for s in s1),
        "length_is_max_tokens": all(len(s["response_ids"]) == a.contract_tokens
                                    for s in s1 if s["finish_reason"] == "length"),
        "same_seed_same_ids": ids(s1) == ids(s2), "other_seed_differs": ids(s1) != ids(s3),
        "same_seed_max_logprob_diff": max(same, default=None),
        "finish_reasons": dict(Counter(s["finish_reason"] for s in s1)),
        "distinct_per_prompt": [len({tuple(s["response_ids"]) for s in s1[p * n:(p + 1) * n]}) for p in range(P)],
        "example": [s1[0]["prompt"], s1[0]["response"][:200]],
    }
    for dtype in ("float32", "bfloat16"):  # the reference, and what the trainer recomputes in on a GPU
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, dtype)).cuda().eval()
        deltas = []
        with torch.no_grad():
            for s in s1:  # logits at position t predict token t+1: the response's log-probs start at len(p) - 1
                p, r = s["prompt_ids"], s["response_ids"]
                logits = model(torch.tensor([p + r], device="cuda")).logits[0, len(p) - 1:len(p) + len(r) - 1].float()
                hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r, device="cuda")[:, None]).squeeze(-1)
                deltas.append(hf - torch.tensor(s["rollout_logprobs"], device="cuda"))
        d = torch.cat(deltas).abs()
        out[f"logprob_vs_hf_{dtype}"] = {"tokens": d.numel(), "mean_abs": round(d.mean().item(), 5),
                                         "p99_abs": round(d.quantile(0.99).item(), 5), "max_abs": round(d.max().item(), 5)}
        del model
        free_cuda()
    return out


def _contract_line(name: str, c: dict) -> str:
    if "logprob_vs_hf_float32" not in c:
        return f"  {name} contract: {c.get('error', 'not run')}"
    bad = [k for k, v in c.items() if v is False]
    lp32, lp16 = c["logprob_vs_hf_float32"], c["logprob_vs_hf_bfloat16"]
    return (f"  {name} contract: {'all checks ok' if not bad else 'FAILED ' + ', '.join(bad)}, finish "
            f"{c['finish_reasons']}; |logprob - recompute| over {lp32['tokens']} tokens: fp32 mean "
            f"{lp32['mean_abs']:.4f} max {lp32['max_abs']:.4f}; bf16 mean {lp16['mean_abs']:.4f} max {lp16['max_abs']:.4f}")


def summary(r: dict) -> str:
    s, hf, sc, st, vl = (r.get(k, {}) for k in ("settings", "hf", "static", "vllm_start", "vllm"))
    tps = lambda box, k: box[k]["tokens_per_s"] if "tokens_per_s" in box.get(k, {}) else float("nan")  # noqa: E731
    lines = [f"{r['label']} on {r['gpu']}: {s['batch']} x ({s['prompt_tokens']} prompt + {s['new_tokens']} new) tokens",
             f"  HF generate bf16  tok/s: no logprobs {tps(hf, 'no_logprobs'):.0f}, logprobs {tps(hf, 'logprobs'):.0f};"
             f" recompute of log-probs in one bf16 forward {tps(hf, 'recompute_logprobs'):.0f} tok/s",
             f"  static engine bf16 (log-probs included) tok/s: CUDA graphs {tps(sc, 'cuda_graphs'):.0f}, eager "
             f"{tps(sc, 'eager'):.0f}; = {tps(sc, 'cuda_graphs') / tps(hf, 'logprobs'):.1f}x HF with log-probs, "
             f"{tps(sc, 'cuda_graphs') / tps(hf, 'no_logprobs'):.1f}x HF without"]
    if vl:
        lines += [f"  vLLM {st.get('vllm_version', '?')} (start {st.get('cold_start_s', 'ERR')} s, enforce_eager "
                  f"{st.get('enforce_eager')}, gpu_memory_utilization {s['gpu_mem']})  tok/s: no logprobs "
                  f"{tps(vl, 'no_logprobs'):.0f}, logprobs=0 {tps(vl, 'logprobs'):.0f}, unseeded "
                  f"{tps(vl, 'no_logprobs_unseeded'):.0f}",
                  f"  static (with log-probs) / vLLM without log-probs: "
                  f"{tps(sc, 'cuda_graphs') / tps(vl, 'no_logprobs'):.2f} (seeded), "
                  f"{tps(sc, 'cuda_graphs') / tps(vl, 'no_logprobs_unseeded'):.2f} (unseeded)"]
    lines.append(_contract_line("static", r.get("static_contract", {})))
    if vl:
        lines.append(_contract_line("vLLM", r.get("vllm_contract", {})))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--label", default="smollm2")
    for flag, default in (("--batch", 256), ("--prompt-tokens", 128), ("--new-tokens", 256), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--contract-tokens", type=int, default=64, help="the engine's max_new_tokens (contract stage)")
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs in vLLM")
    ap.add_argument("--no-vllm", action="store_true", help="HF and the static engine only")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    vocab, special = min(len(tok), AutoConfig.from_pretrained(a.model).vocab_size), set(tok.all_special_ids)
    allowed = torch.tensor([i for i in range(vocab) if i not in special])  # vLLM rejects ids past the tokenizer
    pick = torch.randint(len(allowed), (a.batch, a.prompt_tokens), generator=torch.Generator().manual_seed(a.seed))
    prompts = allowed[pick].tolist()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    r: dict = {"label": a.label, "model": os.path.abspath(a.model), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "settings": {k: v for k, v in vars(a).items() if k not in ("model", "out", "label")}
               | {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "n": 1, "min_tokens": a.new_tokens}}
    guarded(r, "hf", lambda: hf_stage(a, prompts, pad_id))
    guarded(r, "static", lambda: static_stage(a, prompts, r))
    state: dict = {}
    if not a.no_vllm:
        guarded(r, "vllm_start", lambda: vllm_start(a, state))
    engine = state.get("engine")
    if engine is not None:
        r["vllm"] = {}
        guarded(r["vllm"], "warmup", lambda: vllm_run(a, engine.llm, prompts[:8], 0, True, 8))
        runs = {"no_logprobs": (None, True), "logprobs": (0, True), "no_logprobs_unseeded": (None, False)}
        for name, (lp, sd) in runs.items():
            guarded(r["vllm"], name, lambda lp=lp, sd=sd: vllm_run(a, engine.llm, prompts, lp, sd, a.new_tokens))
        guarded(r, "vllm_contract", lambda: contract_stage(a, engine))
    path = os.path.join(a.out, f"rollout_{a.label}.json")
    with open(path, "w") as f:
        json.dump(r, f, indent=1, default=str)
    print(summary(r), f"wrote {path}", sep="\n", flush=True)
    try:
        engine.llm.llm_engine.engine_core.shutdown()  # the engine core is a child process
    except Exception:  # noqa: BLE001 - none started, or exiting anyway
        pass


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this module
    main()
