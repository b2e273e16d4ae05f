"""Job: model inference of a stage that does not train — reward scoring, evaluation — so that on a GPU
host it runs in its own process (through Pipes) and its memory is gone when the stage ends.

Config JSON: ``{"task": name, "result_json": path, **the task's fields}``. Tasks, by name only (no code
comes from the config):

- ``rewards``: ``rollouts_parquet``, ``reward_config`` (RewardConfig fields), ``reward_model_path``,
  ``device``, ``dtype``, ``max_response_length`` (the rollouts' token limit, for ``overlong_buffer``),
  ``out_parquet`` — ``compute_rewards`` over the rollouts, written to ``out_parquet``;
- ``reference_logprobs``: ``model_path``, ``pairs_parquet``, ``out_parquet``, ``max_length``, ``batch_size``,
  ``device``, ``dtype`` — the frozen reference's summed completion log-probs of each pair;
- ``evaluation``: ``models`` ({name: HF folder}), ``eval_prompts_parquet``, ``pairs_parquet``,
  ``reference_parquet``, ``options`` (``evaluate_models`` keywords) — results per model;
- ``advantages``: ``rewards_parquet``, ``settings`` (AdvantageSettings fields), ``reference_model_path`` and
  ``kl_in_reward_coef`` (KL in the reward: a coefficient carried over), ``critic_path`` (estimators that need
  values), ``device``, ``out_parquet`` —
  ``advantages_with_models`` over the scored samples, written to ``out_parquet``; its batch metrics.

``run_task`` is also what the asset calls when the stage runs in the Dagster process (CPU).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import pandas as pd

from batchrl.training.timing import phases
from batchrl.training.jobs._runtime import Reporter, run_job


def score_rewards(config: dict) -> dict:
    from batchrl.training.rewards.registry import RewardConfig, compute_rewards

    table = pd.read_parquet(config["rollouts_parquet"])
    scored = compute_rewards(table, RewardConfig(**config["reward_config"]),
                             reward_model_path=config.get("reward_model_path"), device=config.get("device", "cpu"),
                             dtype=config.get("dtype", "float32"),
                             max_response_length=config.get("max_response_length"))
    scored.to_parquet(config["out_parquet"], index=False)
    return {"samples": len(scored), "mean_reward": float(scored["reward"].mean()) if len(scored) else 0.0}


def evaluate_models(config: dict) -> dict:
    from batchrl.training.evaluation.evaluate import evaluate_models

    prompts = pd.read_parquet(config["eval_prompts_parquet"]).to_dict("records")
    pairs = pd.read_parquet(config["pairs_parquet"])
    reference = pd.read_parquet(config["reference_parquet"])
    return evaluate_models(config["models"], arith_eval=prompts, pairs=pairs, reference=reference, **config["options"])


def reference_logprobs(config: dict) -> dict:
    from batchrl.training.trainer.reference import compute_reference_logprobs

    return compute_reference_logprobs(config["model_path"], config["pairs_parquet"], config["out_parquet"],
                                      max_length=config["max_length"], batch_size=config["batch_size"],
                                      batch_tokens=config.get("batch_tokens"), device=config.get("device"),
                                      dtype=config.get("dtype", "auto"))


def advantages(config: dict) -> dict:
    from batchrl.training.rl.advantages import AdvantageSettings, advantages_with_models

    out = advantages_with_models(pd.read_parquet(config["rewards_parquet"]), AdvantageSettings(**config["settings"]),
                                 reference_model_path=config.get("reference_model_path"),
                                 kl_in_reward_coef=config.get("kl_in_reward_coef"),
                                 critic_path=config.get("critic_path"),
                                 device=config.get("device", "cpu"))
    out.to_parquet(config["out_parquet"], index=False)
    flat = [a for row in out["advantages"] for a in row]
    return {"samples": len(out), "adv_abs_mean": float(pd.Series(flat, dtype=float).abs().mean()) if flat else 0.0,
            # plain floats: the KL controller's state is read back exactly by the next iteration
            "metrics": {k: float(v) for k, v in out.attrs.get("metrics", {}).items()}}


TASKS: dict[str, Callable[[dict], dict]] = {"rewards": score_rewards, "reference_logprobs": reference_logprobs,
                                            "evaluation": evaluate_models, "advantages": advantages}


def run_task(config: dict) -> dict[str, Any]:
    """Run the named task; its result (JSON-able) is also written to ``result_json``."""
    try:
        task = TASKS[config["task"]]
    except KeyError:
        raise ValueError(f"unknown inference task {config.get('task')!r}; known: {sorted(TASKS)}") from None
    result = task(config)
    with open(config["result_json"], "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=str)
    return result


def work(config: dict, rep: Reporter):
    rep.log(f"inference task {config['task']}")
    with phases.recording() as clock:
        result = run_task(config)
    summary = {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool))}
    return {**summary, "phase_s": clock.summary()}, None


if __name__ == "__main__":
    sys.exit(run_job(work))
