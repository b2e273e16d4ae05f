"""Every rule of what one stage's run config needs from another's, each written once here, and the one whole-run
check that applies them before anything runs.

Each stage's config validates itself (allowed names come from the registries; ``AdvantageSettings`` refuses KL in
the reward at ``kl_coef: 0``, ``PolicyConfig`` a critic its own ``adv_estimator`` does not use); what one stage's
choice requires from another's is checked by ``check_run_config`` (``RunConfigError``, naming the fields), from
what the estimators registered they need (``algos.registry``): a greedy baseline for ReMax, several samples per
prompt for group estimators, a critic for GAE, one place for the KL term, reward names that resolve, a DPO pair
source that exists and whose graph has the inputs it takes, one truncation (``max_length``) for the reference
log-probs and DPO, a sandbox that is a boundary for tool-using rollouts (or ``allow_weak_sandbox``); and, given the code location's resources, what the policy update takes from the rollout engine
(its temperature; sampled-token log-probs, which vLLM reports only when asked). It is called by
``runs.run_config.check_whole_run`` (`batchrl run`'s up-front ``validate_plan``, and ``runs.execute.execute_assets``
before executing) and by the ``rollouts`` asset for runs launched from the UI, which skip both (without the
resources' rules there).

Three rules are applied again when their stage runs, to what its input was materialised with (an input from an
earlier run, which no up-front check saw): ``kl_placement`` by ``policy_checkpoint`` against the advantages'
lineage, ``reference_mismatch`` by ``dpo_checkpoint`` against the reference log-probs' lineage, ``self_play_missing``
by ``dpo_pairs`` against its own inputs.
"""
from __future__ import annotations

from typing import Iterable

import dagster as dg
import pydantic

from batchrl.assets.stage_configs import ReferenceConfig, RolloutConfig
from batchrl.common.run_config_error import RunConfigError, pydantic_problems
from batchrl.resources.profiles import pair_sources
from batchrl.training.rl.advantages import AdvantageSettings
from batchrl.training.algos import estimator_needs
from batchrl.training.rewards.registry import RewardConfig, get_reward_function
from batchrl.training.trainer.config import DPOConfig, PolicyConfig


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
    _check_rl(ops, chosen)
    _check_dpo_lengths(ops, chosen)
    _check_base_model_parts(ops, chosen)
    _check_sandbox(ops, chosen)
    if resources is not None and "rollout_engine" in resources:
        _check_engine(ops, chosen, resources["rollout_engine"])
    _check_pair_source(ops, graph)


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


def _check_rl(ops: dict, chosen) -> None:
    rollouts = _config(ops, "rollouts", RolloutConfig) if chosen("rollouts") else None
    algorithm = _config(ops, "advantages", AdvantageSettings) if chosen("advantages") else None
    policy = _config(ops, "policy_checkpoint", PolicyConfig) if chosen("policy_checkpoint") else None
    if chosen("rewards"):
        rewards = _config(ops, "rewards", RewardConfig)
        for field, spec in [("rule", rewards.rule), *((f"custom.{k}", v) for k, v in rewards.custom.items())]:
            try:
                get_reward_function(spec)
            except (KeyError, TypeError, ImportError, AttributeError) as err:
                raise RunConfigError(f"ops.rewards.config.{field}: {err}") from None
    if algorithm is not None:
        needs = estimator_needs(algorithm.estimator)
        where = f"ops.advantages.config.estimator={algorithm.estimator}"
        if rollouts is not None and "reward_baselines" in needs and not rollouts.greedy_baseline:
            raise RunConfigError(f"{where} needs a greedy baseline per prompt: set ops.rollouts.config.greedy_baseline: "
                                 "true")
        if rollouts is not None and "groups" in needs and rollouts.samples_per_prompt < 2:
            raise RunConfigError(f"{where} compares responses within a prompt's group: "
                                 f"ops.rollouts.config.samples_per_prompt={rollouts.samples_per_prompt} must be >= 2")
        if rollouts is not None and rollouts.agent is not None and "values" in needs:
            raise RunConfigError(f"{where} with ops.rollouts.config.agent: the critic is not trained with the "
                                 "trajectories' loss mask (tool observations would get values); use a group "
                                 "estimator (grpo, rloo, ...) for tool-using rollouts")
        if policy is not None and "values" in needs and not policy.critic:
            raise RunConfigError(f"{where} needs critic values: set ops.policy_checkpoint.config.critic: true "
                                 "(a value model trained with the policy)")
    if rollouts is not None and policy is not None and rollouts.off_policy_steps:
        # the update's ratio is to the policy it starts from (recomputed); the samples' own policy, one update
        # behind, is corrected for by the truncated importance weights against the engine's log-probs
        if policy.old_logprobs != "recompute" or policy.rollout_is_threshold is None:
            raise RunConfigError(
                "ops.rollouts.config.off_policy_steps=1 samples one update behind the policy being trained: set "
                "ops.policy_checkpoint.config.old_logprobs: recompute and rollout_is_threshold (a number) so the "
                f"staleness is corrected (now old_logprobs={policy.old_logprobs}, "
                f"rollout_is_threshold={policy.rollout_is_threshold})")
        if policy.critic:
            raise RunConfigError("ops.rollouts.config.off_policy_steps=1 with ops.policy_checkpoint.config.critic: "
                                 "the critic's values and returns are on-policy here; use a group estimator (grpo, "
                                 "rloo, ...) for off-policy iterations")
    if algorithm is not None and policy is not None:
        if "adv_estimator" in policy.model_fields_set and policy.adv_estimator != algorithm.estimator:
            raise RunConfigError(f"ops.policy_checkpoint.config.adv_estimator={policy.adv_estimator} differs from "
                                 f"ops.advantages.config.estimator={algorithm.estimator}")
        problem = kl_placement(algorithm.use_kl_in_reward, policy.use_kl_in_reward, policy.kl_coef)
        if problem:
            raise RunConfigError(problem)


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


def _check_engine(ops: dict, chosen, engine) -> None:
    """What the policy update takes from the rollout engine: the sampling temperature, and the sampled tokens'
    log-probs where it uses them (vLLM reports them only with ``sampled_logprobs``)."""
    if not chosen("policy_checkpoint"):
        return
    policy = _config(ops, "policy_checkpoint", PolicyConfig)
    if policy.temperature != engine.temperature:
        raise RunConfigError(
            f"ops.policy_checkpoint.config.temperature={policy.temperature} differs from "
            f"resources.rollout_engine.temperature={engine.temperature}: the update computes the log-probs of the "
            "samples at the temperature they were sampled at; set the same on both")
    if engine.kind != "vllm" or engine.sampled_logprobs:
        return
    if policy.old_logprobs == "rollout":
        raise RunConfigError("ops.policy_checkpoint.config.old_logprobs='rollout' takes the engine's sampled-token "
                             "log-probs, which resources.rollout_engine.kind='vllm' reports only with "
                             "resources.rollout_engine.sampled_logprobs: true (or use old_logprobs: recompute)")
    if chosen("rollouts") and _config(ops, "rollouts", RolloutConfig).off_policy_steps:
        raise RunConfigError("ops.rollouts.config.off_policy_steps=1 corrects the staleness with the engine's "
                             "sampled-token log-probs, which resources.rollout_engine.kind='vllm' reports only with "
                             "resources.rollout_engine.sampled_logprobs: true")


def kl_placement(advantages_kl_in_reward: bool, policy_kl_in_reward: bool, policy_kl_coef: float,
                 materialised: bool = False) -> str | None:
    """Where the KL term lives: the advantages stage and the policy update must agree on it, or it vanishes (the
    policy drops its KL loss for a KL the rewards do not carry) or counts twice (the rewards carry it and the
    policy adds its loss). The problem, None when they agree. ``materialised``: the advantages' side is what an
    advantages artifact was computed with (``policy_checkpoint``), not this run's config."""
    if policy_kl_in_reward and not advantages_kl_in_reward:
        if materialised:
            return ("policy_checkpoint: config use_kl_in_reward is true (no KL loss) but the advantages were "
                    "computed without KL in the reward (advantages config use_kl_in_reward: false): the KL "
                    "term would silently vanish; set advantages use_kl_in_reward: true")
        return ("ops.policy_checkpoint.config.use_kl_in_reward: true turns the KL loss off but "
                "ops.advantages.config.use_kl_in_reward is false: the KL term would vanish")
    if advantages_kl_in_reward and not policy_kl_in_reward and policy_kl_coef > 0:
        if materialised:
            return ("policy_checkpoint: the advantages already carry the KL penalty in their rewards "
                    "(advantages config use_kl_in_reward: true) and config use_kl_in_reward is false, so the "
                    "KL loss would count it twice; set policy_checkpoint use_kl_in_reward: true or kl_coef: 0")
        return ("ops.advantages.config.use_kl_in_reward: true puts KL in the reward, and "
                "ops.policy_checkpoint.config.use_kl_in_reward: false adds it again as a loss: set "
                "policy use_kl_in_reward: true (or its kl_coef: 0)")
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
