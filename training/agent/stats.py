"""Headline numbers of a batch of trajectories (rollouts metadata, the bench, the evaluation)."""
from __future__ import annotations

from typing import Any, Sequence


def trajectory_stats(rows: Sequence[dict[str, Any]], loop_stats: dict[str, float], wall_s: float) -> dict[str, float]:
    """Mean tool calls / turns per rollout, tool error rate, finish-reason shares, the model's own tokens per
    second of generation (observations excluded), and the share of the rollout wall spent running tools
    (``tool_share``: the loop's wall in the tool phase over the whole; calls run side by side, so the sum of the
    calls' own wall times, ``tool_call_s_sum``, can exceed it)."""
    n = max(1, len(rows))
    calls = sum(int(r["tool_calls"]) for r in rows)
    own = sum(int(sum(r["loss_mask"])) for r in rows)
    out = {"mean_tool_calls": calls / n, "mean_turns": sum(int(r["num_turns"]) for r in rows) / n,
           "tool_error_rate": sum(int(r["tool_errors"]) for r in rows) / max(1, calls),
           "model_tokens_per_s": own / loop_stats["generate_s"] if loop_stats.get("generate_s") else 0.0,
           "mean_model_tokens": own / n,
           "tool_s": float(loop_stats.get("tool_s", 0.0)),
           "tool_call_s_sum": float(loop_stats.get("tool_call_wall_sum_s", 0.0)),
           "tool_share": float(loop_stats.get("tool_s", 0.0)) / wall_s if wall_s > 0 else 0.0}
    for reason in ("stop", "length", "max_turns"):
        out[f"finish/{reason}"] = sum(r["finish_reason"] == reason for r in rows) / n
    return out
