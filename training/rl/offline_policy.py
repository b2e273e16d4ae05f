"""Policy optimisation on logged completions with rewards — no new samples (TRL #3663 / #2680, verl #2661).

A scored log (``prompt``, ``response``, ``score``; optionally the logging policy's per-token log-probs) becomes
the policy trainer's batch (``trainer/policy.py``: prompt/response ids, per-token advantages, optional
``rollout_logprobs``), then one update runs exactly as an on-policy iteration would. Objectives
(``OfflinePolicyConfig.objective``), each assuming something about the log:

- ``grpo``: responses that share a prompt form a group; advantage = (score - group mean) / (group std + 1e-6)
  (verl's GRPO), clipped PPO surrogate. Assumes >= 2 logged responses per prompt (groups of one carry no
  comparison and are left out, counted). With ``importance_weights`` the loss is multiplied by truncated
  importance weights min(pi_old / mu, threshold) against the logged log-probs mu (needs them).
- ``awr``: advantage-weighted regression: w = min(exp((score - baseline) / beta), max_weight), baseline = the
  group mean (the batch mean for a prompt logged once); maximise sum w log pi. Works on single responses.
- ``rwr``: reward-weighted regression: w = softmax of score / beta within each prompt group (times its size).
"""
from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
import pandas as pd
from pydantic import Field, model_validator

from batchrl.training.trainer.config import PolicyConfig

OBJECTIVES = ("grpo", "awr", "rwr")


class OfflinePolicyConfig(PolicyConfig):
    """The policy trainer's config plus how logged completions become its batch."""

    objective: Literal[OBJECTIVES] = Field("awr", description=(  # type: ignore[valid-type]
        "grpo: group-normalised advantages over responses sharing a prompt, clipped surrogate; awr: "
        "advantage-weighted regression; rwr: reward-weighted regression (training/rl/offline_policy.py)"))
    weight_beta: float = Field(1.0, gt=0, description="awr/rwr temperature: w = exp(advantage / weight_beta)")
    max_weight: float = Field(20.0, gt=0, description="awr: weights are clipped at this value")
    importance_weights: bool = Field(False, description=(
        "grpo: multiply the loss by truncated importance weights min(pi_old / mu, rollout_is_threshold) against "
        "the logging policy's per-token log-probs (the log must carry them: logprobs_field)"))
    logprobs_field: str = Field("logprobs", description=(
        "the log's per-token log-probs of the logging policy (a column or a key of the extra column): one "
        "float per completion token of this tokenizer, end-of-sequence token included"))
    max_length: int = Field(512, ge=8, description="prompt + completion tokens; longer completions are cut")
    max_rows: int | None = Field(None, ge=1, description=(
        "train on a seeded sample of this many logged completions, their weights computed over all of them "
        "(smoke-size runs of a large model on CPU); all when unset"))

    @model_validator(mode="after")
    def _objective_combinations(self):
        if self.importance_weights and self.objective != "grpo":
            raise ValueError(f"importance_weights apply to objective grpo, not {self.objective!r} (its weights "
                             "already stay close to the logged data)")
        if self.importance_weights and self.rollout_is_threshold is None:
            raise ValueError("importance_weights needs rollout_is_threshold (the truncation c of min(ratio, c))")
        if self.objective != "grpo" and self.policy_loss != "weighted_regression":
            self.policy_loss = "weighted_regression"  # the AWR/RWR step: weights, no ratio
        elif self.objective == "grpo" and self.policy_loss == "weighted_regression":
            raise ValueError("objective grpo uses a clipped surrogate (policy_loss vanilla or gspo)")
        if self.old_logprobs == "rollout":
            raise ValueError("old_logprobs 'rollout' is for on-policy samples; on logged completions use "
                             "importance_weights (grpo) against the logged log-probs")
        return self

    def trainer_fields(self) -> dict[str, Any]:
        """The fields ``PolicyConfig`` takes (what the policy trainer job validates); importance weights off
        unless asked for."""
        fields = {k: v for k, v in self.model_dump().items() if k in PolicyConfig.model_fields}
        if not self.importance_weights:
            fields["rollout_is_threshold"] = None
        return fields


def has_logged_logprobs(table, field: str) -> bool:
    """Whether a scored-logs table (pandas or Arrow) carries ``field``, as a column or in its extra column."""
    # an Arrow table's ``columns`` are its arrays, not their names
    columns = table.column_names if hasattr(table, "column_names") else list(table.columns)
    if field in columns:
        return True
    extra = table["extra"].to_pylist() if "extra" in columns and not hasattr(table, "iloc") else (
        list(table["extra"]) if "extra" in columns else [])
    return any(isinstance(e, str) and field in json.loads(e) for e in extra)


def _logged_logprobs(frame: pd.DataFrame, field: str) -> list | None:
    if field in frame.columns:
        return list(frame[field])
    if "extra" in frame.columns:
        values = [json.loads(e).get(field) if isinstance(e, str) else None for e in frame["extra"]]
        if any(v is not None for v in values):
            return values
    return None


def logged_batch(frame: pd.DataFrame, tokenizer: Any, cfg: OfflinePolicyConfig) -> tuple[pd.DataFrame, dict]:
    """The policy trainer's batch from validated scored logs, and metrics saying what was used. Raises
    ``ValueError`` naming the row when logged log-probs are asked for and missing or of the wrong length."""
    from batchrl.training.data.text import encode_prompt_completions, encode_prompts, prompt_messages
    from batchrl.training.trainer.batching import seeded_rows

    frame = frame.reset_index(drop=True)
    group = frame.groupby("prompt", sort=False)["score"]
    sizes = group.transform("size").to_numpy()
    scores = frame["score"].astype(float).to_numpy()
    metrics: dict[str, Any] = {"rows": len(frame), "prompts": int(group.ngroups),
                               "objective": cfg.objective}
    if cfg.objective == "grpo":
        keep = sizes >= 2
        metrics["rows_without_a_group"] = int((~keep).sum())
        mean, std = group.transform("mean").to_numpy(), group.transform("std").to_numpy()
        weights = (scores - mean) / (np.nan_to_num(std) + 1e-6)
    elif cfg.objective == "awr":
        keep = np.ones(len(frame), dtype=bool)
        baseline = np.where(sizes >= 2, group.transform("mean").to_numpy(), scores.mean())
        weights = np.minimum(np.exp((scores - baseline) / cfg.weight_beta), cfg.max_weight)
    else:  # rwr
        keep = np.ones(len(frame), dtype=bool)
        scaled = scores / cfg.weight_beta
        e = np.exp(scaled - frame.assign(_s=scaled).groupby("prompt", sort=False)["_s"].transform("max").to_numpy())
        weights = e / frame.assign(_e=e).groupby("prompt", sort=False)["_e"].transform("sum").to_numpy() * sizes
    frame, weights = frame[keep].reset_index(drop=True), weights[keep]
    if frame.empty:
        raise ValueError(f"objective {cfg.objective}: no logged completion to train on (grpo needs prompts "
                         "logged with two or more scored responses)")
    # the cap after the weights: a group's baseline stays the mean of all its logged scores
    frame = seeded_rows(frame.assign(_weight=weights), cfg.max_rows, cfg.seed)
    weights = frame.pop("_weight").to_numpy()
    prompts, responses = frame["prompt"].tolist(), frame["response"].tolist()
    encoded = encode_prompt_completions(tokenizer, prompts, responses, cfg.max_length,
                                        prompt_ids=encode_prompts(tokenizer, prompts,
                                                                  prompt_messages(frame.to_dict("records"))))
    prompt_ids = [ids[:start] for ids, start in encoded]
    response_ids = [ids[start:] for ids, start in encoded]
    batch = pd.DataFrame({"prompt": prompts, "prompt_ids": prompt_ids, "response_ids": response_ids,
                          "reward": frame["score"].astype(float).to_numpy(),
                          "advantages": [[float(w)] * len(r) for w, r in zip(weights, response_ids)]})
    if cfg.importance_weights:
        batch["rollout_logprobs"] = _checked_logprobs(frame, response_ids, cfg.logprobs_field)
    metrics.update(samples=len(batch), weight_mean=float(np.mean(weights)), weight_max=float(np.max(weights)),
                   mean_score=float(batch["reward"].mean()))
    return batch, metrics


def _checked_logprobs(frame: pd.DataFrame, response_ids: list[list[int]], field: str) -> list[list[float]]:
    logged = _logged_logprobs(frame, field)
    if logged is None:
        raise ValueError(f"importance_weights: the log has no {field!r} field (the logging policy's per-token "
                         "log-probs); set logprobs_field, or train without importance weights")
    out = []
    for row, (values, ids) in enumerate(zip(logged, response_ids)):
        values = [] if values is None else list(values)
        if len(values) != len(ids):
            where = frame["source_file"].iloc[row] if "source_file" in frame else f"row {row}"
            line = frame["source_line"].iloc[row] if "source_line" in frame else "?"
            raise ValueError(f"{where}:{line}: field {field!r} holds {len(values)} log-probs, the completion has "
                             f"{len(ids)} tokens with this tokenizer (end-of-sequence included): the logged "
                             "log-probs must come from this model's tokenizer")
        out.append([float(v) for v in values])
    return out
