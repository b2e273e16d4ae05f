"""The run configs of the stages whose rules other stages' checks read (``run_rules``): prompts, the RL stages
(each the stage's own knobs; what several of them share is the RL recipe, ``resources.rl_recipe``) and the
reference log-probs. The assets that take them import them from here, so the rules never import an asset module.

A field that moved to the recipe stays in its stage's run config under its old name, refused with where it went
(``with_moved_fields``): `batchrl run`, profiles and the launchpad say "set resources.rl_recipe.kl_loss_coef", not
"no such key"."""
from typing import Any, Literal, Optional

import dagster as dg
import pydantic
from pydantic import Field, model_validator

from batchrl.assets.common import run_config_for
from batchrl.common.run_config_error import RunConfigError, pydantic_problems
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.training.agent.config import AgentConfig
from batchrl.training.rl.advantages import AdvantageSettings, AdvantageStageSettings
from batchrl.training.trainer.config import PolicyConfig, PolicyUpdateConfig

AgentRunConfig = run_config_for(AgentConfig, "AgentRunConfig")
RECIPE = "resources.rl_recipe"


def with_moved_fields(name: str, run_config: type[dg.Config], stage: str, moved: dict[str, str]) -> type[dg.Config]:
    """A run config ``name``: ``run_config`` still naming each field that moved out of ``ops.<stage>.config``
    (``moved``: old name -> where it is set now), so that a value given under the old name is refused in one line saying where it went: when the
    stage's config is built (a launchpad run) and by its ``library_model`` (`batchrl run`'s check of every op)."""
    def refusal(config: dict) -> str | None:
        given = [name for name in moved if config.get(name) is not None]
        return "; ".join(f"{name}={config[name]!r} moved from ops.{stage}.config to the RL recipe: set {moved[name]}"
                         for name in given) or None

    def refuse_moved(self):
        problem = refusal(self.__dict__)
        if problem:
            raise ValueError(problem)
        return self

    def with_old_names(base: type, class_name: str, description: str) -> type:
        fields = {old: (Optional[Any], Field(None, description=f"{description}: set {where}"))
                  for old, where in moved.items()}
        return pydantic.create_model(class_name, __base__=base, __module__=__name__, **fields,
                                     __validators__={"refuse_moved": model_validator(mode="after")(refuse_moved)})

    library = run_config.library_model
    if isinstance(library, type):  # the library model too, so its rules and the old names are checked together
        library = with_old_names(library, f"{library.__name__}WithOldNames", f"moved to the RL recipe from {stage}")
    else:
        checks = library

        def library(**config):
            problem = refusal(config)
            if problem:
                raise ValueError(problem)
            return checks(**{k: v for k, v in config.items() if k not in moved})
    cls = with_old_names(run_config, name, f"moved from ops.{stage}.config")
    cls.library_model = library
    cls.moved_fields = tuple(moved)
    return cls


def stage_fields(config: dg.Config) -> dict:
    """A stage's own config values, without the moved names (always None once the config was built)."""
    return config.model_dump(exclude=set(getattr(config, "moved_fields", ())))


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
    """``ops.rollouts.config``'s own rules, checked by ``batchrl run`` before anything runs and at launch."""
    if config.get("agent") is not None:
        AgentConfig.model_validate(config["agent"])


class RolloutStageConfig(dg.Config):
    """``policy``: "latest" samples from the last policy_checkpoint of this base model's chain (the
    base model itself when the chain is new); "base" always samples from the base model.
    ``max_prompts``: a sample of that many prompts drawn with ``seed`` (all prompts when unset).
    Samples per prompt, the greedy baseline and off-policy sampling are the RL recipe's."""

    policy: str = Field("latest", description="latest: the promoted checkpoint of this base model's chain (the base "
                        "model on a new chain); base: always the base model")
    max_prompts: int | None = Field(None, description="a seeded sample of this many prompts (all when unset)")
    seed: int = Field(0, description="seed of the prompt sample and of sampling")
    agent: Optional[AgentRunConfig] = Field(None, description="multi-turn, tool-using rollouts (docs/AGENT.md): "
                                            "the model's tool calls run in the sandbox and their output comes back "
                                            "as a turn; unset: one turn per rollout")

    @model_validator(mode="after")
    def _combinations(self):  # the library model's rules (e.g. user tools need tool_call_json), at launch
        _check_rollout_config(**self.model_dump())
        return self


RolloutStageConfig.library_model = _check_rollout_config
RolloutConfig = with_moved_fields("RolloutConfig", RolloutStageConfig, "rollouts", {
    "samples_per_prompt": f"{RECIPE}.samples_per_prompt",
    "greedy_baseline": f"{RECIPE}.estimator: remax (the greedy baseline follows the estimator)",
    "off_policy_steps": f"{RECIPE}.off_policy_steps", "sample_ahead": f"{RECIPE}.sample_ahead"})
AdvantageConfig = with_moved_fields("AdvantageConfig", run_config_for(AdvantageStageSettings, "AdvantageStageConfig"),
                                   "advantages", {
    "estimator": f"{RECIPE}.estimator", "use_kl_in_reward": f"{RECIPE}.kl_placement: reward",
    "kl_coef": f"{RECIPE}.kl_in_reward_coef", **{name: f"{RECIPE}.{name}" for name in (
        "kl_penalty", "kl_ctrl", "target_kl", "kl_horizon")}})
PolicyRunConfig = with_moved_fields("PolicyRunConfig", run_config_for(PolicyUpdateConfig, "PolicyUpdateRunConfig"),
                                   "policy_checkpoint", {
    "adv_estimator": f"{RECIPE}.estimator", "critic": f"{RECIPE}.estimator: gae (the critic follows the estimator)",
    "kl_coef": f"{RECIPE}.kl_loss_coef", "kl_type": f"{RECIPE}.kl_loss_type",
    "use_kl_in_reward": f"{RECIPE}.kl_placement (reward: the KL in the reward, no KL loss)",
    "old_logprobs": f"{RECIPE}.old_logprobs", "rollout_is_threshold": f"{RECIPE}.rollout_is_threshold"})


def advantage_settings(config: dg.Config, recipe: RLRecipe) -> AdvantageSettings:
    """The advantages job's settings: the stage's knobs and the recipe's part (its validators see both: dynamic
    sampling needs a group estimator)."""
    return _joined("advantages", AdvantageSettings, config, recipe.advantage_part())


def policy_config(config: dg.Config, recipe: RLRecipe) -> PolicyConfig:
    """The policy trainer job's config: the stage's knobs and the recipe's part."""
    return _joined("policy_checkpoint", PolicyConfig, config, recipe.policy_part())


def _joined(asset: str, model: type[pydantic.BaseModel], config: dg.Config, part: dict):
    try:
        return model(**stage_fields(config), **part)
    except pydantic.ValidationError as err:  # a rule between the stage's knobs and the recipe: one line each
        raise RunConfigError("; ".join(pydantic_problems(err, f"ops.{asset}.config with {RECIPE}"))) from None


def rollout_recipe_problem(config: RolloutStageConfig, recipe: RLRecipe) -> str | None:
    """What ``ops.rollouts.config`` cannot do under ``recipe`` (None: nothing): checked before a run
    (``run_rules``) and by the rollouts step, which reads both."""
    where = f"{RECIPE}.estimator={recipe.estimator} with ops.rollouts.config.agent"
    if config.agent is not None and recipe.greedy_baseline:
        return (f"{where}: the greedy baseline is one turn without tools, not a trajectory of the same agent; ReMax "
                "over tool-using rollouts is not supported")
    if config.agent is not None and recipe.critic:
        return (f"{where}: the critic is not trained with the trajectories' loss mask (tool observations would get "
                "values); use a group estimator (grpo, rloo, ...) for tool-using rollouts")
    if recipe.sample_ahead and config.policy != "latest":
        return (f"{RECIPE}.sample_ahead with ops.rollouts.config.policy={config.policy}: the samples drawn ahead come "
                "from the new checkpoint, which only policy: latest samples next")
    return None


class ReferenceConfig(dg.Config):
    max_length: int = Field(256, description="tokens per prompt + completion")
    batch_size: int = Field(16, description="pairs per forward pass (at most)")
    batch_tokens: Optional[int] = Field(None, ge=1, description="padded tokens per forward pass, both rows of a "
                                        "pair counted: set, short pairs go in larger batches (up to batch_size "
                                        "pairs), which keeps a GPU busy; unset, batch_size alone")
    dtype: str = Field("auto", description="auto = bfloat16 on GPU, float32 on CPU")
