"""Descriptions of the run-config fields the launchpad shows, for configs generated from library models.

A generated field's description is, in order: the library field's own ``description`` (or a base class's),
the comment on its line in the library source (``lr_schedule: ... = "constant"  # after warmup, ...``), or the entry
below (fields the library leaves undocumented, in the words of this project's conventions).
"""
from __future__ import annotations

import ast
import functools
import inspect
import io
import tokenize

FIELD_DOCS = {
    # trainer (every DeepSpeed stage)
    "lr": "peak learning rate of AdamW",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "optimiser steps of linear warmup from 0 to lr",
    "max_grad_norm": "gradient clipping: the global gradient norm is scaled down to this",
    "micro_batch_size": "examples per forward/backward pass on one rank",
    "grad_accum": "micro-batches accumulated per optimiser step (derived from global_batch_size when that is set)",
    "max_length": "tokens per sequence; longer ones are truncated",
    "seed": "seed of python/numpy/torch RNGs and of the data order: same inputs, config and seed give the same bytes",
    "zero_stage": "DeepSpeed ZeRO stage (0-3); ZeRO 1-3 resume only on the same number of ranks",
    "keep_last": "trainer checkpoints kept in the work folder (older ones deleted)",
    "epochs": "passes over the training data",
    # DPO (TRL 1.x conventions)
    "beta": "DPO temperature: weight of the log-ratio against the reference",
    "loss_type": "DPO-family loss: sigmoid (DPO), hinge (SLiC), ipo (length-normalised), robust (cDPO)",
    "label_smoothing": "probability a preference label is flipped (robust / cDPO); 0 = plain DPO",
    # reward model
    "max_pairs": "cap on the preference pairs the reward model trains on (all when unset)",
    # policy update (verl 0.9.1 core_algos conventions)
    "adv_estimator": "advantage estimator the batch was computed with (must match advantages.estimator)",
    "policy_loss": "policy-gradient loss (a registered name, e.g. vanilla PPO clip)",
    "clip_ratio_low": "PPO clip: lower bound 1 - clip_ratio_low of the importance ratio",
    "clip_ratio_high": "PPO clip: upper bound 1 + clip_ratio_high of the importance ratio",
    "clip_ratio_c": "dual-clip constant c (> 1) bounding the loss of negative advantages",
    "kl_coef": "weight of the KL term to the reference (base) model",
    "kl_type": "KL estimator: k1, k2, k3 (= low_var_kl, clamped to +-10) ...",
    "use_kl_in_reward": "put the KL to the reference into the token rewards (then no KL loss term)",
    "loss_agg_mode": "loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm",
    "entropy_coef": "weight of the entropy bonus",
    "ppo_epochs": "passes over the rollout batch per policy update",
    "temperature": "sampling temperature the rollouts used (log-probs are recomputed at it)",
    "old_logprobs": "where the behaviour log-probs come from: the rollouts' or recomputed by the trainer",
    "rollout_is_threshold": "truncated importance-sampling cap for rollout vs trainer log-prob mismatch (none = off)",
    "critic": "train a value model with the policy (needed by the gae estimator); exported as critic_checkpoint",
    "critic_lr": "learning rate of the critic",
    "cliprange_value": "PPO value clip range of the critic",
    # advantages
    "estimator": "advantage estimator: grpo, rloo, gae, remax, reinforce_plus_plus, ... (a registered name)",
    "gamma": "discount factor (gae)",
    "lam": "GAE lambda",
    "norm_adv_by_std": "GRPO: divide by the group's (unbiased) std + 1e-6; off = Dr. GRPO",
    "critic_init": "where a new critic starts: the policy or the reward model",
    "kl_penalty": "KL estimator used in the reward (k1, k2, k3/low_var_kl, ...)",
    "kl_ctrl": "KL coefficient controller: fixed or adaptive (carried over between iterations)",
    "target_kl": "adaptive controller: the KL it steers toward",
    "kl_horizon": "adaptive controller: horizon (in samples) of its proportional update",
    # rewards
    "rule": "rule reward: a registered reward name or module:function",
    "custom": "more rewards by name: {name: registered reward or module:function}",
    "weights": "mix weights per reward name (rule, reward_model, custom names)",
    "routing": "per-category weights: {category: {reward: weight}}, overriding weights for that category",
    "route_by": "the row field that routing keys on",
    "reward_model_path": "score with this HF reward-model folder instead of the reward_model asset",
    "rm_batch_size": "sequences per reward-model forward pass",
    "rm_max_length": "tokens per sequence the reward model reads",
    # ingestion contract
    "kind": "the contract: preferences (prompt/chosen/rejected) or scored (prompt/response/score)",
    "field_mapping": "{source field (dotted path into nested records): contract field}",
    "chat_mapping": "read a chat transcript (messages list) into prompt/response fields",
    "drop_fields": "source fields dropped before the contract is checked",
    "reader": "a custom reader for any format: module:Class",
    "batch_rows": "rows per processing batch (outputs do not depend on it)",
    "block_bytes": "bytes per read block, cut at newlines (outputs do not depend on it)",
    "row_group_rows": "rows per Parquet row group of the outputs",
    "collapse_whitespace": "collapse runs of whitespace to one space",
    "max_prompt_tokens": "quarantine rows whose prompt is longer (prompt_too_long); none = no limit",
    "tokenizer_path": "tokenizer that counts max_prompt_tokens (whitespace split when unset)",
    "reject_threshold": "the blocking check stops training when the share of quarantined rows passes this",
    "pair_min_margin": "scored logs: best - worst score needed for a preference pair",
    "compression": "Parquet compression codec of the outputs",
    "threads": "worker threads (one block each)",
    "dedupe_memory_keys": "exact-dedupe keys held in memory before spilling sorted runs to disk",
    "dedupe_spill_dir": "folder for the dedupe spill files (a temp folder when unset)",
    "fast_json": "the vectorised pyarrow JSON path for clean lines (off = per-line reference path for all)",
    "engine": "ingestion engine",
    "storage_options": "fsspec options for the landing (set by the landing resource; credentials are redacted)",
    "extra_fields": "keep fields outside the contract in one `extra` JSON column instead of quarantining the row",
    "on_bad_file": "an unreadable file stops the stage (fail) or is skipped and recorded (skip)",
    # chat_mapping
    "messages_field": "the field holding the list of chat messages",
    "role_key": "key of a message's role",
    "content_key": "key of a message's text",
    "assistant_role": "the role whose last message is the response",
    "turn_separator": "text between turns when earlier turns are joined into the prompt",
}


def _comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the trailing comments on field lines in ``cls``'s own source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    tree = ast.parse(source.lstrip() if source[:1].isspace() else source)
    out = {}
    for node in tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found = [comments[line] for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                     if line in comments]
            if found:
                out[node.target.id] = " ".join(found)
    return out


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """Trailing comments of ``cls`` and its bases' fields (the subclass's own win)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base.__module__.startswith("batchrl."):
            out.update(_comments(base))
    return out


def _inherited(model_cls: type, name: str) -> str | None:
    """The description of ``name`` in a base class (a subclass that only changes the default keeps it)."""
    for base in model_cls.__mro__[1:]:
        field = getattr(base, "model_fields", {}).get(name)
        if field is not None and field.description:
            return field.description
    return None


def describe(model_cls: type, name: str, description: str | None) -> str | None:
    """The description a generated run-config field shows (see the module docstring)."""
    return (description or _inherited(model_cls, name) or field_comments(model_cls).get(name)
            or FIELD_DOCS.get(name))
