"""Headline numbers of a batch of trajectories (rollouts metadata, the bench, the evaluation)."""
from __future__ import annotations

from typing import Any, Sequence


def trajectory_stats(rows: Sequence[dict[str, Any]], loop_stats: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Mean tool calls / turns per rollout, tool error rate, finish-reason shares, the model's own tokens per
    second of generation (observations excluded; ``engine_tokens_per_s`` counts every token the engine made, the
    tails generated after a tool call and cut off included, ``kept_token_share`` the share kept), and the share of
    the rollout wall spent running tools
    (``tool_share``: the loop's wall in the tool phase over the whole; calls run side by side, so the sum of the
    calls' own wall times, ``tool_call_s_sum``, can exceed it)."""
    n = max(1, len(rows))
    calls = sum(int(r["tool_calls"]) for r in rows)
    own = sum(int(sum(r["loss_mask"])) for r in rows)
    out = {"mean_tool_calls": calls / n, "mean_turns": sum(int(r["num_turns"]) for r in rows) / n,
           "tool_error_rate": sum(int(r["tool_errors"]) for r in rows) / max(1, calls),
           "model_tokens_per_s": own / loop_stats["generate_s"] if loop_stats.get("generate_s") else 0.0,
           "mean_model_tokens": own / n,
           "engine_tokens_per_s": (loop_stats.get("generated_tokens", 0) / loop_stats["generate_s"]
                                   if loop_stats.get("generate_s") else 0.0),
           "kept_token_share": own / loop_stats["generated_tokens"] if loop_stats.get("generated_tokens") else 1.0,
           "tool_s": float(loop_stats.get("tool_s", 0.0)),
           "tool_call_s_sum": float(loop_stats.get("tool_call_wall_sum_s", 0.0)),
           "tool_share": float(loop_stats.get("tool_s", 0.0)) / wall_s if wall_s > 0 else 0.0}
    for reason in ("stop", "length", "max_turns"):
        out[f"finish/{reason}"] = sum(r["finish_reason"] == reason for r in rows) / n
    # the sandbox the tool calls ran in: its level and each piece in force (training/sandbox.describe)
    out.update({f"sandbox/{key}": value for key, value in (loop_stats.get("sandbox") or {}).items()})
    return out


def trajectory_markdown(row: dict[str, Any], max_chars: int = 400) -> str:
    """One trajectory as Markdown for the UI: a line per turn (role, tool, status, exit code, wall) and its text in a
    fenced block, each cut to ``max_chars``; the finish reason last."""
    lines = [f"**prompt** {row['prompt'][:max_chars]}", ""]
    for i, turn in enumerate(row["turns"], 1):
        facts = [turn["role"]] + [f"{key} {turn[key]}" for key in ("tool", "status", "exit_code")
                                  if turn.get(key) is not None]
        if turn["role"] != "assistant":
            facts.append(f"{turn['wall_s']:.2f} s" + (", cut" if turn["truncated"] else ""))
        text = str(turn["content"]).replace("```", "'''")[:max_chars]  # a fence inside would close the block
        lines += [f"{i}. {', '.join(map(str, facts))}", "", "```", text, "```", ""]
    lines.append(f"finish_reason **{row['finish_reason']}**, {row['tool_calls']} tool calls")
    return "\n".join(lines)
