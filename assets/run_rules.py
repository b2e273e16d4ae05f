"""Every rule of what one stage's run config needs from another's, each written once here, and the one whole-run
check that applies them before anything runs.

Each stage's config validates itself (allowed names come from the registries), and so does the RL recipe
(``resources.rl_recipe``, ``resources.rl_recipe.RLRecipe``: the estimator, samples per prompt, where the KL lives,
off-policy sampling, each combination refused when written). ``check_run_config`` (``RunConfigError``, naming the
fields) builds the recipe a run reads and each RL stage's job config from its own knobs and the recipe's part (so
their validators see both: dynamic sampling needs a group estimator), and checks what the rest needs: rollouts'
agent against the recipe's baselines, reward names that resolve, a DPO pair source that exists and whose graph has
the inputs it takes, one truncation (``max_length``) for the reference log-probs and DPO, a sandbox that is a
boundary for tool-using rollouts (or ``allow_weak_sandbox``); and, given the code location's resources, what the
policy update takes from the rollout engine (its temperature; sampled-token log-probs, which vLLM reports only
when asked). It is called by ``runs.run_config.check_whole_run`` (`batchrl run`'s up-front ``validate_plan``, and
``runs.execute.execute_assets`` before executing). A run launched from the UI meets the same rules where the
stages read them: the recipe when Dagster builds the resource, each RL stage's config with the recipe when it
starts, and the rules below against what its inputs were materialised with.

Three rules are applied again when their stage runs, to what its input was materialised with (an input from an
earlier run, which no up-front check saw): ``materialised_advantages_problem`` by ``policy_checkpoint`` against the
advantages' lineage and the recipe, ``reference_mismatch`` by ``dpo_checkpoint`` against the reference log-probs'
lineage, ``self_play_missing`` by ``dpo_pairs`` against its own inputs.
"""
from __future__ import annotations

from typing import Iterable

import dagster as dg
import pydantic

from batchrl.assets.stage_configs import (
    RECIPE, AdvantageConfig, PolicyRunConfig, ReferenceConfig, RolloutConfig, advantage_settings, policy_config,
    rollout_recipe_problem,
)
from batchrl.common.run_config_error import RunConfigError, pydantic_problems
from batchrl.resources.profiles import pair_sources
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.training.rewards.registry import RewardConfig, get_reward_function
from batchrl.training.trainer.config import DPOConfig


def _config(ops: dict, asset: str, cls: type):
    try:
        return cls(**(ops.get(asset) or {}).get("config", {}))
    except pydantic.ValidationError as err:
        raise RunConfigError("; ".join(pydantic_problems(err, f"ops.{asset}.config"))) from None


def check_run_config(run_config: dict | None, selection: Iterable[str] | None = None, graph=None,
                     resources: dict | None = None) -> None:
    """Raise ``RunConfigError`` naming the fields of the first impossible combination among the selected assets
    (all when ``selection`` is None). ``graph``: the code location's asset graph, for the DPO pair source's
    inputs (None: that rule is left to the ``dpo_pairs`` step); ``resources``: the code location's, for what the
    policy update needs from the rollout engine (None: those rules are not applied)."""
    ops = (run_config or {}).get("ops", {}) or {}
    chosen = _chooser(set(selection) if selection else None)
    recipe = run_recipe(run_config, resources)
    _check_rl(ops, chosen, recipe)
    _check_dpo_lengths(ops, chosen)
    _check_base_model_parts(ops, chosen)
    _check_sandbox(ops, chosen)
    if resources is not None and "rollout_engine" in resources:
        _check_engine(ops, chosen, resources["rollout_engine"], recipe)
    _check_pair_source(ops, graph)


def run_recipe(run_config: dict | None, resources: dict | None = None) -> RLRecipe:
    """The RL recipe a run reads: the code location's ``rl_recipe`` (the environment's, with a profile's and the
    ``-c`` files' fields over it; the default recipe without one) and the run config's
    ``resources.rl_recipe.config`` over that, as Dagster builds it. ``RunConfigError`` names the field refused."""
    base = (resources or {}).get("rl_recipe") or RLRecipe()
    given = ((((run_config or {}).get("resources") or {}).get("rl_recipe") or {}).get("config")) or {}
    try:
        return RLRecipe(**{**base.model_dump(), **given})
    except pydantic.ValidationError as err:
        raise RunConfigError("; ".join(pydantic_problems(err, RECIPE))) from None


def _check_base_model_parts(ops: dict, chosen) -> None:
    """A split GGUF base model: every part installed before anything runs (a missing package is named with the
    part; the hashes are checked when the parts are joined). Only a run that builds the base model needs them."""
    parts = ((ops.get("base_model") or {}).get("config") or {}).get("gguf_parts")
    if not parts or not chosen("base_model"):
        return
    from batchrl.training.models.gguf_parts import resolve_parts
    from batchrl.training.models.gguf import GgufSourceError

    try:
        resolve_parts(parts)
    except GgufSourceError as err:
        raise RunConfigError(f"ops.base_model.config.gguf_parts: {err}") from None


def _check_sandbox(ops: dict, chosen) -> None:
    """Tool-using rollouts run model-written code: refused where the sandbox is not a boundary (``training/sandbox``
    levels) unless the stage's agent config says ``allow_weak_sandbox: true``, in one line naming the level and why."""
    from batchrl.training import sandbox

    for asset in ("rollouts", "evaluation"):
        agent = ((ops.get(asset) or {}).get("config") or {}).get("agent")
        if agent is None or not chosen(asset):
            continue
        try:
            level = sandbox.isolation_level()
        except RuntimeError as err:  # BATCHRL_SANDBOX names a level that does not work here
            raise RunConfigError(f"ops.{asset}.config.agent: {err}") from None
        problem = sandbox.weak_level_refusal(level, bool(agent.get("allow_weak_sandbox")), f"ops.{asset}.config.agent")
        if problem:
            raise RunConfigError(problem)


def _chooser(selected: set[str] | None):
    def chosen(*assets: str) -> bool:
        return selected is None or all(a in selected for a in assets)

    return chosen


def _check_rl(ops: dict, chosen, recipe: RLRecipe) -> None:
    """Each selected RL stage's config with the recipe's part, built as the stage builds it; the reward names."""
    if chosen("rollouts"):
        problem = rollout_recipe_problem(_config(ops, "rollouts", RolloutConfig), recipe)
        if problem:
            raise RunConfigError(problem)
    if chosen("advantages"):
        advantage_settings(_config(ops, "advantages", AdvantageConfig), recipe)
    if chosen("policy_checkpoint"):
        policy_config(_config(ops, "policy_checkpoint", PolicyRunConfig), recipe)
    if chosen("rewards"):
        rewards = _config(ops, "rewards", RewardConfig)
        for field, spec in [("rule", rewards.rule), *((f"custom.{k}", v) for k, v in rewards.custom.items())]:
            try:
                get_reward_function(spec)
            except (KeyError, TypeError, ImportError, AttributeError) as err:
                raise RunConfigError(f"ops.rewards.config.{field}: {err}") from None


def _check_dpo_lengths(ops: dict, chosen) -> None:
    """The DPO loss compares the policy's log-probs with the reference's over the same completion tokens: both
    stages truncate pairs at the same ``max_length`` (``training.trainer.dpo.check_reference_tokens`` finds a
    mismatch only inside the training job)."""
    if not chosen("reference_logprobs", "dpo_checkpoint"):
        return  # a reference from an earlier run: dpo_checkpoint checks its recorded max_length (reference_mismatch)
    problem = reference_mismatch(_config(ops, "reference_logprobs", ReferenceConfig).max_length,
                                 _config(ops, "dpo_checkpoint", DPOConfig).max_length)
    if problem:
        raise RunConfigError(problem)


def reference_mismatch(reference_max_length: int, dpo_max_length: int, materialised: bool = False) -> str | None:
    """The problem when the reference log-probs and DPO truncate pairs differently, None when they agree.
    ``materialised``: the reference's side is what a reference_logprobs artifact was computed with."""
    if reference_max_length == dpo_max_length:
        return None
    if materialised:
        return (f"ops.dpo_checkpoint.config.max_length={dpo_max_length} differs from the reference log-probs' "
                f"max_length={reference_max_length}: DPO compares both over the same completion tokens; set the same "
                "max_length on dpo_checkpoint, or rematerialise reference_logprobs with it")
    return (f"ops.dpo_checkpoint.config.max_length={dpo_max_length} differs from "
            f"ops.reference_logprobs.config.max_length={reference_max_length}: DPO compares both over the same "
            "completion tokens; set the same max_length on both")


def _check_engine(ops: dict, chosen, engine, recipe: RLRecipe) -> None:
    """What the policy update takes from the rollout engine: the sampling temperature, and the sampled tokens'
    log-probs where the recipe uses them (vLLM reports them only with ``sampled_logprobs``)."""
    if not chosen("policy_checkpoint"):
        return
    policy = _config(ops, "policy_checkpoint", PolicyRunConfig)
    if policy.temperature != engine.temperature:
        raise RunConfigError(
            f"ops.policy_checkpoint.config.temperature={policy.temperature} differs from "
            f"resources.rollout_engine.temperature={engine.temperature}: the update computes the log-probs of the "
            "samples at the temperature they were sampled at; set the same on both")
    if engine.kind != "vllm" or engine.sampled_logprobs:
        return
    if recipe.old_logprobs == "rollout":
        raise RunConfigError(f"{RECIPE}.old_logprobs='rollout' takes the engine's sampled-token log-probs, which "
                             "resources.rollout_engine.kind='vllm' reports only with "
                             "resources.rollout_engine.sampled_logprobs: true (or use old_logprobs: recompute)")
    if chosen("rollouts") and recipe.off_policy_steps:
        raise RunConfigError(f"{RECIPE}.off_policy_steps=1 corrects the staleness with the engine's sampled-token "
                             "log-probs, which resources.rollout_engine.kind='vllm' reports only with "
                             "resources.rollout_engine.sampled_logprobs: true")


def materialised_advantages_problem(advantages_config: dict, recipe: RLRecipe) -> str | None:
    """The advantages a policy update reads may come from an earlier run with another recipe, which no up-front
    check saw: the problem when their lineage ``config`` disagrees with ``recipe`` on what the update builds on
    (the estimator; where the KL lives: in their rewards, or the update's loss), None when it agrees."""
    estimator = advantages_config.get("estimator")
    if estimator is not None and estimator != recipe.estimator:
        return (f"policy_checkpoint: the advantages were computed with estimator {estimator} but {RECIPE}.estimator "
                f"is {recipe.estimator}: rematerialise advantages with this recipe")
    in_reward = bool(advantages_config.get("use_kl_in_reward", False))
    if in_reward and recipe.kl_placement != "reward":
        return (f"policy_checkpoint: the advantages carry the KL in their rewards (computed with kl_placement reward) "
                f"but {RECIPE}.kl_placement is {recipe.kl_placement}"
                + (": the KL loss would count it twice" if recipe.kl_placement == "loss" else "")
                + "; rematerialise advantages with this recipe")
    if not in_reward and recipe.kl_placement == "reward":
        return (f"policy_checkpoint: {RECIPE}.kl_placement is reward (no KL loss) but the advantages were computed "
                "without KL in the reward: the KL term would vanish; rematerialise advantages with this recipe")
    return None


def _check_pair_source(ops: dict, graph) -> None:
    """A known pair source; a self-play one needs a DPO path with the rewards input (when ``graph`` is given)."""
    source = ((ops.get("dpo_pairs") or {}).get("config") or {}).get("source")
    if not isinstance(source, str):
        return  # none given (logged); another type is Dagster's config schema's to refuse
    key = dg.AssetKey("dpo_pairs")
    has_rewards = graph is None or not graph.has(key) or dg.AssetKey("rewards") in graph.get(key).parent_keys
    try:
        problem = self_play_missing(source, has_rewards)
    except ValueError as error:
        raise RunConfigError(str(error)) from None
    if problem:
        raise RunConfigError(problem)


def self_play_missing(source: str, has_rewards_input: bool) -> str | None:
    """A ``dpo_pairs`` source that takes the policy's scored samples needs its ``rewards`` input (a code location
    built with self-play pairs): the problem, None when it has it or takes no self pairs. ValueError (naming it)
    for an unknown source."""
    if has_rewards_input or "self" not in pair_sources(source):
        return None
    return (f"dpo_pairs: source {source!r} takes pairs from the policy's scored samples, but this code location's "
            "DPO path has no rewards input (logged pairs only, so it runs beside the RL branch): set "
            "BATCHRL_DPO_SELF_PLAY=1, or use a profile whose dpo_pairs source takes self pairs (`batchrl run` "
            "does this itself from its run config)")
