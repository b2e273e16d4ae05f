"""Frozen-reference log-probs for DPO, computed once per (pairs, base model) and stored as Parquet.

Per pair: ``ref_chosen_logp`` / ``ref_rejected_logp`` = sum over completion tokens (eos included)
of ``log p_ref(token | prompt, previous tokens)``, the TRL convention; ``chosen_len`` /
``rejected_len`` = number of completion tokens. Precomputing takes the reference model out of the
training process (TRL's ``precompute_ref_log_probs``).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.phases import beside_load, phase
from batchrl.training.trainer.batching import (completion_logprobs, encode_pairs, length_sorted_batches, pair_batch,
                                               to_device)


@torch.no_grad()
def pair_logprobs(model: Any, items: list[dict], pad_id: int, device: Any, *, batch_size: int | None = None,
                  max_tokens: int | None = None, fused: bool = True) -> dict[str, np.ndarray]:
    """Summed completion log-probs (eos included: the DPO convention) and token counts of each encoded pair
    (``encode_pairs``) under ``model`` in eval mode: ``chosen_logp, rejected_logp`` (float64), ``chosen_len,
    rejected_len`` (int64), in input order. Batches of similar length: ``batch_size`` pairs and/or
    ``max_tokens`` padded tokens (both rows of a pair counted; 32 pairs when neither is given)."""
    was_training = model.training
    model.eval()
    lengths = [2 * (len(it["chosen_prompt"]) + max(len(it["chosen"]), len(it["rejected"]))) for it in items]
    batches = length_sorted_batches(lengths, batch_size or (None if max_tokens else 32), max_tokens)
    # results stay on the device until the end: a per-batch .cpu() would make the host wait for each
    # forward pass before building the next batch (the GPU then idles while the host pads)
    logps, counts = [], []
    for idx in batches:
        batch = to_device(pair_batch([items[i] for i in idx], pad_id), device)
        logps.append(completion_logprobs(model, batch, fused=fused).sum(-1).double())
        counts.append(batch["response_mask"].sum(-1).long())
    model.train(was_training)
    cols = {k: np.zeros(len(items), dtype=dtype_) for k, dtype_ in
            (("chosen_logp", np.float64), ("rejected_logp", np.float64), ("chosen_len", np.int64),
             ("rejected_len", np.int64))}
    for idx, logp, count in zip(batches, logps, counts):
        n = len(idx)
        logp, count = logp.cpu().numpy(), count.cpu().numpy()
        cols["chosen_logp"][idx], cols["rejected_logp"][idx] = logp[:n], logp[n:]
        cols["chosen_len"][idx], cols["rejected_len"][idx] = count[:n], count[n:]
    return cols


@torch.no_grad()
def compute_reference_logprobs(model_path: str, pairs_parquet: str, out_parquet: str, *,
                               max_length: int = 256, batch_size: int = 16, batch_tokens: int | None = None,
                               device: str | None = None, dtype: str = "auto") -> dict[str, Any]:
    """Write ``id, ref_chosen_logp, ref_rejected_logp, chosen_len, rejected_len`` (one row per pair,
    input order) to ``out_parquet`` atomically; returns summary metadata. Batches: up to ``batch_size``
    pairs and, when set, ``batch_tokens`` padded tokens (``pair_logprobs``).

    ``dtype="auto"``: bfloat16 on GPU (the precision the GPU trainer runs in; measured 5x faster than
    float32 on an H200, see bench/RESULTS.md), float32 on CPU."""
    from batchrl.training.tiny_model import load_model_and_tokenizer, load_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    pairs = pd.read_parquet(pairs_parquet)
    ids = pairs["id"].astype(str).tolist() if "id" in pairs.columns else [str(i) for i in range(len(pairs))]
    tokenizer = load_tokenizer(model_path)  # the pairs are tokenised while the model loads
    (model, _), items = beside_load(lambda: encode_pairs(tokenizer, pairs.to_dict("records"), max_length),
                                    lambda: load_model_and_tokenizer(model_path, dtype=dtype, device=device))
    with phase("logprobs"):
        logps = pair_logprobs(model, items, tokenizer.pad_token_id, device, batch_size=batch_size,
                              max_tokens=batch_tokens)
    cols = {"ref_chosen_logp": logps["chosen_logp"], "ref_rejected_logp": logps["rejected_logp"],
            "chosen_len": logps["chosen_len"], "rejected_len": logps["rejected_len"]}
    table = pd.DataFrame({"id": ids, **cols})
    os.makedirs(os.path.dirname(os.path.abspath(out_parquet)), exist_ok=True)
    tmp = f"{out_parquet}.tmp-{os.getpid()}"
    table.to_parquet(tmp, index=False)
    os.replace(tmp, out_parquet)
    return {
        "num_pairs": len(table),
        "mean_ref_chosen_logp": float(np.mean(table["ref_chosen_logp"])) if len(table) else 0.0,
        "mean_ref_rejected_logp": float(np.mean(table["ref_rejected_logp"])) if len(table) else 0.0,
        "mean_chosen_len": float(np.mean(table["chosen_len"])) if len(table) else 0.0,
        "mean_rejected_len": float(np.mean(table["rejected_len"])) if len(table) else 0.0,
        "path": out_parquet,
    }
