"""The run configs of the stages whose rules other stages' checks read (``run_rules``): prompts, rollouts and the
reference log-probs. The assets that take them import them from here, so the rules never import an asset module."""
from typing import Literal, Optional

import dagster as dg
from pydantic import Field, model_validator

from batchrl.assets.common import run_config_for
from batchrl.training.agent.config import AgentConfig

AgentRunConfig = run_config_for(AgentConfig, "AgentRunConfig")


class PromptFormatConfig(dg.Config):
    """How a prompt file's rows read (``training/data/prompt_shapes.py``); the training and held-out sets share it."""

    shape: Literal["plain", "gsm8k"] = Field("plain", description="plain: rows carry prompt (+ answer) after "
                                             "field_mapping; gsm8k: the original GSM8K jsonl (prompt = question + "
                                             "prompt_suffix, gold = the number after '####'; a row without it is "
                                             "quarantined with reason missing_gold_answer)")
    prompt_suffix: Optional[str] = Field(None, description="text appended to every prompt; unset: none for plain, "
                                         "verl's ' Let's think step by step and output the final answer after "
                                         "\"####\".' for gsm8k")


class PromptsConfig(PromptFormatConfig):
    """``field_mapping``: ``{source field (dotted path into nested records): prompt field}``, e.g. verl
    Parquet ``{"reward_model.ground_truth": "answer"}``, GSM8K ``{"question": "prompt"}``."""

    field_mapping: dict[str, str] = Field(default_factory=dict, description="{source field (dotted path into "
                                          "nested records): prompt field}")
    data_sources: Optional[list[str]] = Field(None, description="the data_source values a prompt may carry; a prompt "
                                              "with another is refused here, not when rewards run. Unset: the "
                                              "rewards routing keys when this run routes by data_source, else any")


def _check_rollout_config(**config) -> None:
    """``ops.rollouts.config``'s combinations, checked by ``batchrl run`` before anything runs and at launch."""
    if config.get("sample_ahead") and config.get("off_policy_steps"):
        raise ValueError("sample_ahead with off_policy_steps: 1: the off-policy rollouts are prefetched already "
                         "(from the published parent); sampling ahead is the on-policy overlap")
    if config.get("sample_ahead") and config.get("policy", "latest") != "latest":
        raise ValueError(f"sample_ahead with policy: {config['policy']}: the samples drawn ahead come from the new "
                         "checkpoint, which only policy: latest samples next")
    if config.get("agent") is None:
        return
    AgentConfig.model_validate(config["agent"])
    if config.get("greedy_baseline"):
        raise ValueError("agent with greedy_baseline: the greedy baseline is one turn without tools, not a "
                         "trajectory of the same agent; ReMax over tool-using rollouts is not supported")


class RolloutConfig(dg.Config):
    """``policy``: "latest" samples from the last policy_checkpoint of this base model's chain (the
    base model itself when the chain is new); "base" always samples from the base model.
    ``max_prompts``: a sample of that many prompts drawn with ``seed`` (all prompts when unset)."""

    policy: str = Field("latest", description="latest: the promoted checkpoint of this base model's chain (the base "
                        "model on a new chain); base: always the base model")
    samples_per_prompt: int = Field(8, description="sampled responses per prompt (a group, for GRPO/RLOO)")
    max_prompts: int | None = Field(None, description="a seeded sample of this many prompts (all when unset)")
    seed: int = Field(0, description="seed of the prompt sample and of sampling")
    greedy_baseline: bool = Field(False, description="also decode one greedy response per prompt; its reward "
                                  "becomes the prompt's baseline (ReMax, advantages.estimator: remax)")
    agent: Optional[AgentRunConfig] = Field(None, description="multi-turn, tool-using rollouts (docs/AGENT.md): "
                                            "the model's tool calls run in the sandbox and their output comes back "
                                            "as a turn; unset: one turn per rollout")
    off_policy_steps: int = Field(0, ge=0, le=1, description="1: one-step off-policy (verl's one_step_off_policy): "
                                  "sample from the promoted policy's parent, one update behind, so that the job "
                                  "worker samples the next iteration's rollouts (with the seed `batchrl run "
                                  "--rl-iterations N` announces for it) while this iteration's "
                                  "update trains; the staleness is in the rollouts' lineage and the update "
                                  "corrects it (needs the policy's old_logprobs: recompute and "
                                  "rollout_is_threshold). 0: on-policy")
    sample_ahead: bool = Field(False, description="on-policy: the policy update samples the next iteration's "
                               "rollouts (the seed `batchrl run --rl-iterations N` announces for it) from its new "
                               "weights while it exports, hashes and publishes them; the next rollouts step takes them "
                               "(the same samples, so the same data version). Needs job-worker sampling "
                               "(trainer.backend worker, rollout_engine.in_subprocess, not vLLM) and a next "
                               "iteration announced: elsewhere it is off, and the update's metadata says why")

    @model_validator(mode="after")
    def _combinations(self):  # the library model's rules (e.g. user tools need tool_call_json), at launch
        _check_rollout_config(**self.model_dump())
        return self


RolloutConfig.library_model = _check_rollout_config


class ReferenceConfig(dg.Config):
    max_length: int = Field(256, description="tokens per prompt + completion")
    batch_size: int = Field(16, description="pairs per forward pass (at most)")
    batch_tokens: Optional[int] = Field(None, ge=1, description="padded tokens per forward pass, both rows of a "
                                        "pair counted: set, short pairs go in larger batches (up to batch_size "
                                        "pairs), which keeps a GPU busy; unset, batch_size alone")
    dtype: str = Field("auto", description="auto = bfloat16 on GPU, float32 on CPU")
