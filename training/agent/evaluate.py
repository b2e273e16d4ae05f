"""The tool task's evaluation: held-out accuracy with and without tools, and how the model uses them."""
from __future__ import annotations

from typing import Any

import numpy as np

from batchrl.training.agent.config import AgentConfig
from batchrl.training.agent.loop import AgentRollouts
from batchrl.training.agent.stats import trajectory_stats
from batchrl.training.rewards.registry import get_reward_function


def tool_metrics(engine: Any, rows: list[dict], agent: AgentConfig | dict, *, reward: str = "final_answer",
                 seed: int = 0, without_tools: bool = True) -> dict[str, Any]:
    """With ``engine`` (greedy for an evaluation) on ``rows`` (``prompt``, ``answer``, ``category``):

    - ``tool_accuracy``: mean ``reward`` of the final model turn of a rollout with the tools (instructions in the
      system turn, calls run); ``tool_accuracy/<category>`` per category;
    - ``no_tool_accuracy`` (``without_tools``): the same prompts, one turn, no instructions, no calls;
    - ``mean_tool_calls``, ``mean_turns``, ``tool_error_rate``, ``finish/<reason>``, ``tool_share`` (of the
      rollout wall spent running tools), ``model_tokens_per_s`` (``stats.trajectory_stats``)."""
    import time

    config = agent if isinstance(agent, AgentConfig) else AgentConfig.model_validate(agent)
    judge = get_reward_function(reward)
    prompts = [row["prompt"] for row in rows]
    results: dict[str, Any] = {}
    for label, tools in (("tool", True), ("no_tool", False)):
        if not tools and not without_tools:
            continue
        loop = AgentRollouts(engine, config, tools=tools)
        started = time.perf_counter()
        samples = loop.generate(prompts, n=1, seed=seed)
        wall = time.perf_counter() - started
        scores = np.array([float(judge(s["prompt"], s["response"], rows[s["prompt_index"]])) for s in samples])
        results[f"{label}_accuracy"] = float(scores.mean()) if len(scores) else 0.0
        categories = np.array([str(rows[s["prompt_index"]].get("category") or "none") for s in samples])
        for category in sorted(set(categories)):
            results[f"{label}_accuracy/{category}"] = float(scores[categories == category].mean())
        if tools:
            results.update(trajectory_stats(samples, loop.stats, wall))
            results["tool_examples"] = [s["turns"] for s in samples[:2]]
    return results
