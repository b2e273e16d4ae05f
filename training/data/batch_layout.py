"""verl's batch layout and the log-probs of sequences in it, shared by the passes that score sequences without
training (reference log-probs, evaluation's margins, the policy's old log-probs, KL in the reward, critic values) and
by the trainers (``training/trainer/``).

Prompts left-padded to ``P``, completions right-padded to ``R``, one row ``[pad.. prompt | completion ..pad]`` of
length ``P + R``; position ids count real tokens only, so a row's logits do not depend on how much padding its batch
has. The model is asked for the last ``R + 1`` logits only (``logits_to_keep``): logit ``t`` predicts completion
token ``t``. ``pair_logprobs`` and ``sequence_token_logprobs`` score many rows in length-sorted batches, read
back once (``scoring.score_in_batches``). Imports torch, not DeepSpeed.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np
import torch

from batchrl.training.algos import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from batchrl.training.data.packing import pack_prompt_completion, unpack_tokens
from batchrl.training.data.scoring import score_in_batches
from batchrl.training.data.transfer import to_device_async


def _ragged(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, row index of each token, the tokens) of ragged id rows, flattened."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return lengths, np.repeat(np.arange(len(rows)), lengths), flat


def pad_prompt_completion(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                          pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad prompts, right-pad completions; returns input_ids, attention_mask, position_ids,
    responses ``[B, R]`` and response_mask ``[B, R]`` (1 on real completion tokens). Built with array
    indexing, not row by row: on GPUs the host pads the next batch while the device runs this one."""
    (p_len, p_row, p_ids), (c_len, c_row, c_ids) = _ragged(prompts), _ragged(completions)
    P, R, B = int(p_len.max()), max(1, int(c_len.max(initial=0))), len(prompts)
    ids = np.full((B, P + R), pad_id, dtype=np.int64)
    # a token's column: its offset in its row, shifted right so that prompts end at P, completions start there
    ids[p_row, P - p_len[p_row] + np.arange(len(p_ids)) - np.repeat(np.cumsum(p_len) - p_len, p_len)] = p_ids
    ids[c_row, P + np.arange(len(c_ids)) - np.repeat(np.cumsum(c_len) - c_len, c_len)] = c_ids
    columns = np.arange(P + R)
    attention = torch.from_numpy(((columns >= P - p_len[:, None]) & (columns < P + c_len[:, None])).astype(np.int64))
    input_ids = torch.from_numpy(ids)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
            "responses": input_ids[:, P:].clone(), "response_mask": attention[:, P:].float()}


def to_device(batch: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    """Host tensors to ``device`` (to a GPU without a host sync: ``transfer.to_device_async``)."""
    return {k: to_device_async(v, device) if torch.is_tensor(v) else v for k, v in batch.items()}


def pad_floats(seqs: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Ragged float rows (per-token values) right-padded with 0 (and cut) to a float32 ``[B, width]``."""
    out = torch.zeros(len(seqs), width, dtype=torch.float32)
    for i, seq in enumerate(seqs):
        seq = np.asarray(seq, dtype=np.float32)[:width]
        out[i, :len(seq)] = torch.from_numpy(seq)
    return out


# tokens per LM-head chunk in the fused path: on GPUs one [rows, V] bf16 buffer (1.2 GiB at V=152k)
FUSED_CHUNK_ROWS = 4096
# config attributes that put a transform between the LM head and the softmax: those models take the naive path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fused_lm_head(model: Any):
    """``(decoder, lm_head_weight)`` when log-probs can be taken from the decoder's hidden states
    without the model's logits (a bias-free linear head, no logit transform, weights not
    ZeRO-3-partitioned), else None. ``model`` is an HF causal LM or a DeepSpeed engine around one."""
    hf = getattr(model, "module", model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if hasattr(head.weight, "ds_id"):  # ZeRO-3: the weight is partitioned, only the module's forward gathers it
        return None
    if any(getattr(hf.config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return hf.get_decoder(), head.weight


def completion_logprobs(model: Any, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                        with_entropy: bool = False, fused: bool = True):
    """Per-token log-probs ``[B, R]`` of the completion tokens (0 on padding), optionally entropy.

    ``fused`` (where ``fused_lm_head`` allows it): the LM head and log-softmax run chunk by chunk
    (``token_logprobs_from_hidden``; Triton row kernels on GPUs), so the ``[B, R, V]`` float32
    logits are never built; else the model's logits are taken (the naive path, same values up to
    float rounding)."""
    if "packed_index" in batch:
        return _packed_completion_logprobs(model, batch, temperature, with_entropy, fused)
    R = batch["responses"].shape[1]
    parts = fused_lm_head(model) if fused else None
    if parts is not None:
        decoder, weight = parts
        hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"], use_cache=False).last_hidden_state
        labels = batch["responses"].masked_fill(batch["response_mask"] == 0, -100)
        return token_logprobs_from_hidden(hidden[:, -R - 1:-1], weight, labels, temperature=temperature,
                                          with_entropy=with_entropy, chunk_size=FUSED_CHUNK_ROWS)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=R + 1, use_cache=False)
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs_from_logits(logits, batch["responses"]) * batch["response_mask"]
    if not with_entropy:
        return logp
    return logp, entropy_from_logits(logits)


def _packed_completion_logprobs(model: Any, batch: dict[str, torch.Tensor], temperature: float,
                                with_entropy: bool, fused: bool):
    """``completion_logprobs`` of a packed batch (``training.packing``): no attention mask, so the model masks by
    the restarting position ids; the LM head runs on the completion tokens alone."""
    index, labels = batch["packed_index"], batch["responses"].reshape(-1)[batch["packed_slot"]]
    parts = fused_lm_head(model) if fused else None
    if parts is not None:
        decoder, weight = parts
        hidden = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         use_cache=False).last_hidden_state
        out = token_logprobs_from_hidden(hidden.reshape(-1, hidden.shape[-1])[index], weight, labels,
                                         temperature=temperature, with_entropy=with_entropy,
                                         chunk_size=FUSED_CHUNK_ROWS)
        values = out if with_entropy else (out,)
    else:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])[index].float()
        if temperature != 1.0:
            logits = logits / temperature
        values = (token_logprobs_from_logits(logits, labels),) + ((entropy_from_logits(logits),) if with_entropy
                                                                 else ())
    unpacked = tuple(unpack_tokens(v, batch) for v in values)
    return unpacked if with_entropy else unpacked[0]


def encode_pairs(tokenizer: Any, rows: Sequence[dict], max_length: int) -> list[dict]:
    """Tokenise preference rows (``prompt, chosen, rejected``) into prompt / completion id lists."""
    from batchrl.training.data.text import encode_prompt_completions, encode_prompts, prompt_messages

    prompts = [row["prompt"] for row in rows]
    prompt_ids = encode_prompts(tokenizer, prompts, prompt_messages(rows))  # once for both sides; multi-turn context
    encoded = [{"id": str(row.get("id", i))} for i, row in enumerate(rows)]
    for side in ("chosen", "rejected"):
        for item, (ids, start) in zip(encoded, encode_prompt_completions(
                tokenizer, prompts, [row[side] for row in rows], max_length, prompt_ids=prompt_ids)):
            item[f"{side}_prompt"], item[side] = ids[:start], ids[start:]
    return encoded


def pair_batch(items: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one batch (one forward pass for both, as TRL does)."""
    prompts = [it["chosen_prompt"] for it in items] + [it["rejected_prompt"] for it in items]
    completions = [it["chosen"] for it in items] + [it["rejected"] for it in items]
    return pad_prompt_completion(prompts, completions, pad_id)


def pair_logprobs(model: Any, items: list[dict], pad_id: int, device: Any, *, batch_size: int | None = None,
                  max_tokens: int | None = None, fused: bool = True) -> dict[str, np.ndarray]:
    """Summed completion log-probs (eos included: the DPO convention) and token counts of each encoded pair
    (``encode_pairs``) under ``model`` in eval mode: ``chosen_logp, rejected_logp`` (float64), ``chosen_len,
    rejected_len`` (int64), in input order. Batches of similar length: ``batch_size`` pairs and/or
    ``max_tokens`` padded tokens (both rows of a pair counted; 32 pairs when neither is given)."""
    def score(idx: np.ndarray) -> torch.Tensor:
        logp = completion_logprobs(model, to_device(pair_batch([items[i] for i in idx], pad_id), device),
                                   fused=fused).sum(-1).double()
        return torch.stack((logp[:len(idx)], logp[len(idx):]), dim=1)  # [pairs, (chosen, rejected)]

    lengths = [2 * (len(it["chosen_prompt"]) + max(len(it["chosen"]), len(it["rejected"]))) for it in items]
    logps = score_in_batches(model, lengths, score, batch_size=batch_size or (None if max_tokens else 32),
                             max_tokens=max_tokens) if items else np.zeros((0, 2))
    return {"chosen_logp": np.ascontiguousarray(logps[:, 0]), "rejected_logp": np.ascontiguousarray(logps[:, 1]),
            # the completion tokens a row's response mask counts: its completion's length
            "chosen_len": np.array([len(it["chosen"]) for it in items], dtype=np.int64),
            "rejected_len": np.array([len(it["rejected"]) for it in items], dtype=np.int64)}


def sequence_token_logprobs(model: Any, rows: dict[str, list], pad_id: int, device, *,
                            temperature: float, batch_size: int | None = None,
                            max_tokens: int | None = None, packed: bool = False) -> list[np.ndarray]:
    """Per-row response token log-probs (unpadded float32 arrays) of ``rows`` (``prompt_ids``, ``response_ids``)
    under ``model`` in eval mode; batches of ``batch_size`` rows and/or ``max_tokens`` padded tokens, each batch
    ``packed`` (``training.packing``) or one padded row per sequence."""
    prompts, responses = rows["prompt_ids"], rows["response_ids"]
    layout = pack_prompt_completion if packed else pad_prompt_completion

    def score(idx: np.ndarray) -> torch.Tensor:
        batch = to_device(layout([prompts[i] for i in idx], [responses[i] for i in idx], pad_id), device)
        return completion_logprobs(model, batch, temperature=temperature).float()

    if not len(prompts):
        return []
    logps = score_in_batches(model, [len(p) + len(r) for p, r in zip(prompts, responses)], score,
                             batch_size=batch_size, max_tokens=max_tokens)
    return [logps[i, :len(r)] for i, r in enumerate(responses)]


def check_packing_supported(model, device) -> None:
    """Fail at the start of a packed update, not deep in a wrong one, when ``model`` lets packed sequences see each
    other (its attention ignores the restarting position ids: an architecture or a transformers version without
    the packed-sequence mask): the second of two packed sequences must score the same whatever the first holds
    (masked keys weigh exactly 0, so even bf16 gives the same numbers)."""
    vocab = int(getattr(model, "module", model).config.vocab_size)
    ids = [t % vocab for t in range(1, 14)]
    # 8 tokens alone set the row width; the 5-token and the 3-token sequence then share the second row
    prompts, completions = [ids[:6], ids[:3], [ids[3], ids[4]]], [ids[6:8], ids[5:7], [ids[7]]]
    scores = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for neighbour in (ids[:3], ids[8:11]):
                batch = pack_prompt_completion([prompts[0], neighbour, prompts[2]], completions, 0)
                assert batch["input_ids"].shape[0] == 2  # the two share a row
                scores.append(completion_logprobs(model, to_device(batch, device))[2].float())
    finally:
        model.train(was_training)
    gap = float((scores[0] - scores[1]).abs().max())
    if gap > 1e-5:
        raise ValueError(f"pack_samples: {type(getattr(model, 'module', model)).__name__} lets packed sequences "
                         f"attend to each other (a sequence's log-probs moved by {gap:.3g} with its row neighbour's "
                         "tokens): its attention does not mask by restarting position ids here; set pack_samples: "
                         "false")
