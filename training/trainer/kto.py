"""KTO on unpaired binary feedback (thumbs), on the DeepSpeed engine: one plain loop like DPO's.

Loss per example (``algos.kto_loss``, TRL ``KTOTrainer``): with r = logπ(y|x) − logπ_ref(y|x) summed over the
completion, desirable rows ``w_d (1 − σ(β (r − z0)))``, undesirable ``w_u (1 − σ(β (z0 − r)))``; the reference
point z0 = max(0, mean over the micro-batch of logπ − logπ_ref on *mismatched* pairs (each prompt with another
row's completion), without gradient).

The reference log-probs (matched and mismatched pairs) come from the model as loaded, before the first update
(the base model; with LoRA the adapters start at zero, so the same), and are cached in ``out_dir`` keyed by the
run, so a resumed run uses the same ones — the DPO path's reference pass, inside the job.
"""
from __future__ import annotations

import os
from typing import Any

import pandas as pd
import torch

from batchrl.training.algos import kto_kl_reference_point, kto_loss
from batchrl.training.data.batch_layout import completion_logprobs, sequence_token_logprobs
from batchrl.training.trainer.batching import seeded_rows, steps_per_epoch
from batchrl.training.trainer.config import KTOConfig
from batchrl.training.trainer.loop import Report, TrainLoop, completed_run, fit_batch
from batchrl.training.trainer.policy import _row_batch
from batchrl.training.data.transfer import to_device_async

KTO_REFERENCE = "kto_reference.pt"


def load_feedback(feedback_parquet: str, cfg: KTOConfig) -> pd.DataFrame:
    """The feedback rows KTO trains on (``cfg.max_rows``: a seeded sample of them)."""
    frame = pd.read_parquet(feedback_parquet)
    missing = {"prompt", "completion", "label"} - set(frame.columns)
    if missing:
        raise KeyError(f"{feedback_parquet} lacks columns {sorted(missing)} (unpaired feedback: prompt, completion, "
                       "label)")
    if frame.empty:
        raise ValueError(f"{feedback_parquet}: no feedback rows to train on")
    return seeded_rows(frame, cfg.max_rows, cfg.seed)


def encode_feedback(tokenizer: Any, frame: pd.DataFrame, max_length: int) -> dict[str, list]:
    """Prompt/completion ids of every row (``matched``) and of every prompt with the next row's completion
    (``mismatched``: row i's prompt, row (i + 1) mod n's completion), the KL reference point's pairs."""
    from batchrl.training.data.text import encode_prompt_completions, encode_prompts, prompt_messages

    prompts, completions = frame["prompt"].tolist(), frame["completion"].tolist()
    prompt_ids = encode_prompts(tokenizer, prompts, prompt_messages(frame.to_dict("records")))
    shifted = completions[1:] + completions[:1]
    out = {}
    for name, texts in (("matched", completions), ("mismatched", shifted)):
        encoded = encode_prompt_completions(tokenizer, prompts, texts, max_length, prompt_ids=prompt_ids)
        out[name] = {"prompt_ids": [ids[:start] for ids, start in encoded],
                     "response_ids": [ids[start:] for ids, start in encoded]}
    return out


def _reference(loop: TrainLoop, cfg: KTOConfig, rows: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Summed reference log-probs of the matched and mismatched pairs, computed before the first update and
    cached in ``out_dir`` (tensors and the run key only: it loads with ``weights_only=True``)."""
    path = os.path.join(loop.out_dir, KTO_REFERENCE)
    if os.path.exists(path):
        cached = torch.load(path, weights_only=True)
        if cached.get("run_key") == loop.run_key:
            return cached
    pad_id = loop.tokenizer.pad_token_id
    ref: dict[str, Any] = {"run_key": loop.run_key}
    for name, part in rows.items():
        per_token = sequence_token_logprobs(loop.model, part, pad_id, loop.device, temperature=1.0,
                                            max_tokens=cfg.measure_batch_tokens)
        ref[name] = torch.tensor([float(t.sum()) for t in per_token], dtype=torch.float32)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(ref, tmp)
    os.replace(tmp, path)
    return ref


def _summed_logps(loop: TrainLoop, part: dict[str, list], idx, cfg: KTOConfig) -> torch.Tensor:
    batch = _row_batch(part, idx, loop.tokenizer.pad_token_id, loop.device)
    return completion_logprobs(loop.model, batch, fused=cfg.fused_logprobs).sum(-1)


def train_kto(cfg: KTOConfig, *, feedback_parquet: str, model_path: str, out_dir: str,
              report: Report | None = None) -> dict[str, Any]:
    """Train ``model_path`` with KTO on ``feedback_parquet`` (prompt, completion, label); checkpoints in
    ``out_dir/checkpoints``, HF model in ``out_dir/model``. Returns metrics: last step's and the curve."""
    frame = load_feedback(feedback_parquet, cfg)
    cfg = fit_batch(cfg, len(frame))
    inputs = {"feedback": feedback_parquet}
    if (done := completed_run(cfg, model_path=model_path, out_dir=out_dir, inputs=inputs)) is not None:
        return done
    n_steps = steps_per_epoch(len(frame), cfg.micro_batch_size, cfg.grad_accum)
    loop = TrainLoop(cfg, model_path=model_path, out_dir=out_dir, total_steps=cfg.epochs * n_steps,
                     inputs=inputs, report=report)
    rows = encode_feedback(loop.tokenizer, frame, cfg.max_length)
    desirable = torch.as_tensor(frame["label"].astype(bool).to_numpy())
    n_up, n_down = int(desirable.sum()), int((~desirable).sum())
    if n_up == 0 or n_down == 0:
        capped = f" in its sample of max_rows={cfg.max_rows}" if cfg.max_rows else ""
        raise ValueError(f"{feedback_parquet}: KTO needs thumbs up and thumbs down, got {n_up} up / {n_down} down"
                         f"{capped}")
    desirable_weight = cfg.desirable_weight or cfg.undesirable_weight * n_down / n_up  # unset: balanced
    with loop.measure_context("reference_logprobs"):
        ref = _reference(loop, cfg, rows)
    ref_matched, ref_mismatched = ref["matched"], ref["mismatched"]
    lengths = [len(p) + len(r) for p, r in zip(rows["matched"]["prompt_ids"], rows["matched"]["response_ids"])] \
        if cfg.group_by_length else None
    for micro_batches in loop.steps(len(frame), cfg.epochs, lengths):
        for idx in micro_batches:
            with loop.forward_context():
                with torch.no_grad():  # the reference point carries no gradient (TRL)
                    z0 = kto_kl_reference_point(_summed_logps(loop, rows["mismatched"], idx, cfg),
                                                to_device_async(ref_mismatched[idx], loop.device))
                logps = _summed_logps(loop, rows["matched"], idx, cfg)
                up = to_device_async(desirable[idx], loop.device)
                losses, rewards = kto_loss(logps, to_device_async(ref_matched[idx], loop.device), up, z0,
                                           beta=cfg.beta, desirable_weight=desirable_weight,
                                           undesirable_weight=cfg.undesirable_weight)
                loss = losses.mean()
            loop.backward(loss)
            upf = up.to(rewards.dtype)
            loop.accumulate({"loss": loss, "kl": z0,
                             "rewards/desirable": (rewards * upf).sum() / upf.sum().clamp_min(1),
                             "rewards/undesirable": (rewards * (1 - upf)).sum() / (1 - upf).sum().clamp_min(1)})

    result = loop.summary()
    result.update(num_examples=len(frame), num_desirable=n_up, desirable_weight=desirable_weight,
                  desirable_share=desirable_weight * n_up / (desirable_weight * n_up + cfg.undesirable_weight * n_down))
    if not result["stopped_early"]:
        result["model_dir"] = loop.export({k: v for k, v in result.items() if k != "loss_curve"})
    return loop.complete(result)
