"""RL assets: prompts → rollouts → rewards → advantages → policy_checkpoint (→ promoted_policy → rollouts)."""

import os
from typing import Optional

import dagster as dg
import pandas as pd

from batchrl.assets.common import (
    code_version, declared_files, output_file, publish, run_config_for, to_library_config, train_and_publish,
)
from batchrl.assets.iteration_chart import ChainChart
from batchrl.assets.policy_chain import (
    CHAIN, ITERATION, PROMOTED, PROMOTED_POLICY_IN, behaviour_policy, chain_base, current_policy, input_iteration,
    next_iteration, parent_policy, promote,
)
from batchrl.assets.rl_algorithm import critic_inputs, critic_job_inputs, kl_in_reward_inputs, response_length_limit
from batchrl.assets.rollout_prefetch import (
    NO_NEXT_ITERATION, NO_PREFETCH_WORKER, PROMPTS_FILE, SamplingRequest, announced_next_seed, prefetched_folder,
    prompt_subset, sample_ahead_request, start_prefetch,
)
from batchrl.assets.run_rules import materialised_advantages_problem
from batchrl.assets.stage_configs import (
    AdvantageConfig, PolicyRunConfig, PromptsConfig, RolloutConfig, advantage_settings, policy_config,
    rollout_recipe_problem, stage_fields,
)
from batchrl.common import fsutil
from batchrl.resources import (
    Artifact, CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
    TrackingResource, TrainerLauncherResource,
)
from batchrl.resources.artifacts import OPTIONAL_KEY
from batchrl.resources.landing import landing_input
from batchrl.resources.retention import carried_state_problem
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.training.rl.advantages import ALL_GROUPS_KEPT_NOTE
from batchrl.training.data.prompt_shapes import PromptQuarantine
from batchrl.training.data.prompts import load_prompts
from batchrl.training.timing.phases import PhaseClock
from batchrl.training.rewards.registry import OVERLONG_PENALTY, REWARD_MODEL, RULE, RewardConfig
from batchrl.training.data.text import prompt_messages

RewardRunConfig = run_config_for(RewardConfig, "RewardRunConfig")


def known_data_sources(config: PromptsConfig, run_config: dict) -> Optional[list[str]]:
    """The data sources the prompts config names, else those this run's rewards config routes by."""
    if config.data_sources is not None:
        return config.data_sources
    rewards = ((run_config.get("ops") or {}).get("rewards") or {}).get("config") or {}
    if rewards.get("route_by") == "data_source" and rewards.get("routing"):
        return sorted(rewards["routing"])
    return None


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.data.prompts", "batchrl.training.data.prompt_shapes",
                                                    config=PromptsConfig), kinds={"parquet"},
          metadata={**declared_files(table=PROMPTS_FILE, quarantine="quarantine.parquet"), **landing_input("prompts")})
def prompts(context: dg.AssetExecutionContext, config: PromptsConfig, landing: LandingResource,
            storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Rollout prompts (with gold answers for the rule reward), checked at the boundary."""
    landing.require("prompts", "prompts")  # a missing file: one line naming it, not a traceback
    data_sources = known_data_sources(config, context.run.run_config or {})
    quarantine = PromptQuarantine()
    table = load_prompts(landing.prompts, landing.storage_options, mapping=config.field_mapping,
                         data_sources=data_sources, shape=config.shape, suffix=config.prompt_suffix,
                         quarantine=quarantine)
    fs, path = fsutil.filesystem_for(landing.prompts, landing.storage_options)
    source = {"uri": landing.prompts, "sha256": fsutil.sha256_file(fs, path)}
    with storage.staging_dir("prompts") as staging:
        table.to_parquet(output_file(context, staging), index=False)
        if quarantine.rows:  # nothing lost: each left-out row with where, why and its raw text
            pd.DataFrame(quarantine.rows).to_parquet(output_file(context, staging, "quarantine"), index=False)
        return publish(context, storage, catalog, staging,
                       config={"landing": landing.prompts, "field_mapping": config.field_mapping,
                               "data_sources": data_sources, "shape": config.shape,
                               "prompt_suffix": config.prompt_suffix},
                       input_files=[source],
                       metadata={"rows": len(table), "rows_in": len(table) + len(quarantine.rows),
                                 "quarantined": len(quarantine.rows), "reasons": quarantine.reasons(),
                                 "categories": table["category"].value_counts().to_dict()})


# the agent loop's modules, not the package: its evaluate scores sequences, which sampling never does
@dg.asset(group_name="rl",
          code_version=code_version("batchrl.training.rollout", "batchrl.training.agent.loop",
                                     "batchrl.training.agent.stats", "batchrl.resources.rl_recipe",
                                     config=RolloutConfig),
          kinds={"pytorch"}, ins={"promoted_policy": PROMOTED_POLICY_IN}, metadata=declared_files(table="rollouts.parquet"))
def rollouts(context: dg.AssetExecutionContext, config: RolloutConfig, prompts: Artifact, base_model: Artifact,
             promoted_policy: Optional[Artifact], rl_recipe: RLRecipe, rollout_engine: RolloutEngineResource,
             trainer: TrainerLauncherResource, storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """The recipe's ``samples_per_prompt`` sampled responses per prompt from the current policy (the promoted
    checkpoint of this base model's chain, the base model on a new chain), with token log-probs (plus one greedy
    response per prompt when the recipe's estimator is ReMax)."""
    clock = PhaseClock()  # where the step's wall goes outside the sampling job (metadata step_s/*)
    with clock.phase("prepare"):
        problem = rollout_recipe_problem(config, rl_recipe)  # this stage's knobs under the recipe it reads
        if problem:
            raise dg.Failure(problem)
        promoted = current_policy(context, promoted_policy, base_model, config.policy)
        # off-policy: the samples come from the policy the promoted one was trained from (one update behind)
        policy, staleness = behaviour_policy(storage, promoted, rl_recipe.off_policy_steps)
        all_prompts = prompts.read_table()
        table = prompt_subset(all_prompts, config.max_prompts, config.seed)  # a new seeded subset each iteration
        messages = prompt_messages(table.to_dict("records"))  # multi-turn prompts: the engine renders them whole
        request = SamplingRequest(policy, list(table["prompt"]), messages, rl_recipe.samples_per_prompt, config.seed,
                                  None if config.agent is None else config.agent.model_dump())
    with storage.staging_dir("rollouts_work") as workdir, clock.phase("sample"):
        samples, stats = rollout_engine.sample(context, trainer, model_path=policy.path, prompts=request.prompts,
                                               n=request.n, seed=request.seed, workdir=workdir,
                                               cache_dir=storage.cache_dir, messages=messages, agent=request.agent,
                                               prefetched=prefetched_folder(storage, rollout_engine, trainer, request))
        ahead = {}
        if rl_recipe.off_policy_steps:  # the next iteration's, from `promoted`, with the seed the run announced
            next_seed = announced_next_seed(context.run.tags)
            if next_seed is None or not rollout_engine.can_prefetch(trainer):
                ahead = {"prefetch": NO_NEXT_ITERATION if next_seed is None else NO_PREFETCH_WORKER}
            else:
                table_next = prompt_subset(all_prompts, config.max_prompts, next_seed)
                pid = start_prefetch(storage, rollout_engine, trainer, SamplingRequest(
                    promoted, list(table_next["prompt"]), prompt_messages(table_next.to_dict("records")),
                    request.n, next_seed, request.agent))
                ahead = {"prefetch": "started", "prefetch_seed": next_seed, "prefetch_worker_pid": pid}
        if rl_recipe.greedy_baseline:
            from batchrl.training.rl.remax import add_greedy_baselines, greedy_engine

            greedy_dir = os.path.join(workdir, "greedy")
            os.makedirs(greedy_dir, exist_ok=True)
            greedy, _ = greedy_engine(rollout_engine).sample(
                context, trainer, model_path=policy.path, prompts=list(table["prompt"]), n=1,
                seed=config.seed, workdir=greedy_dir, cache_dir=storage.cache_dir, messages=messages)
            samples = add_greedy_baselines(samples, greedy)
    with clock.phase("table"):
        meta = table.reset_index(drop=True).drop(columns=["prompt"])  # answer, category, prompt_messages ...
        samples = samples.join(meta, on="prompt_index")
        shown = {"policy": policy.uri, "staleness": staleness, **ahead, **next_iteration(context.instance, promoted)}
        if config.agent is not None and len(samples):  # one trajectory, every turn, in the UI (all are in the Parquet)
            from batchrl.training.agent.stats import trajectory_markdown

            shown["example_trajectory"] = dg.MetadataValue.md(trajectory_markdown(samples.iloc[0].to_dict()))
    with storage.staging_dir("rollouts") as staging:
        with clock.phase("write"):
            samples.to_parquet(output_file(context, staging), index=False)
        return publish(context, storage, catalog, staging, seed=config.seed,
                       config={**stage_fields(config), **rl_recipe.rollout_part(),
                               "engine": rollout_engine.model_dump(), "chain_base": chain_base(policy),
                               "staleness": staleness},
                       # off-policy: the policy sampled and the promoted one it stood behind (what reproduce pins)
                       inputs={"prompts": prompts, "policy": policy, **({PROMOTED: promoted} if staleness else {})},
                       metadata={**{k: v for k, v in stats.items() if k != "content_hash"}, **shown,
                                 **{f"step_s/{k}": v for k, v in clock.summary().items()}})


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.rewards.registry"), kinds={"pytorch"},
          ins={"reward_model": dg.AssetIn(metadata={OPTIONAL_KEY: True})},
          metadata=declared_files(table="rewards.parquet"))
def rewards(context: dg.AssetExecutionContext, config: RewardRunConfig, rollouts: Artifact,
            reward_model: Optional[Artifact], storage: StorageResource, catalog: CatalogResource,
            compute: ComputeResource, trainer: TrainerLauncherResource) -> dg.Output:
    """Rule reward + reward-model score per sample, mixed by weights (optionally routed by category). The
    reward model is an input only when the mix weighs it: at weight 0 it is neither required nor loaded."""
    reward_config = to_library_config(config, RewardConfig)
    if reward_config.needs_reward_model and reward_model is None:
        raise dg.Failure("rewards: the reward mix weighs the reward model (weights "
                         f"{reward_config.weights}, routing {reward_config.routing}) but reward_model has never "
                         "been materialised: materialise it first (batchrl run --select reward_model) or set its "
                         "weight to 0")
    inputs = {"rollouts": rollouts}
    if reward_config.needs_reward_model:
        inputs["reward_model"] = reward_model
    with storage.staging_dir("rewards_work") as workdir, storage.staging_dir("rewards") as staging:
        out = output_file(context, staging)
        compute.run(context, trainer, "rewards", {
            "rollouts_parquet": rollouts.file(), "reward_config": reward_config.model_dump(),
            "max_response_length": response_length_limit(rollouts),  # L_max of the overlong buffer
            "reward_model_path": reward_model.path if "reward_model" in inputs else None,
            "device": compute.device, "dtype": compute.dtype, "out_parquet": out},
            workdir=workdir, uses_models=reward_config.needs_reward_model)
        scored = pd.read_parquet(out)
        components = [c for c in (RULE, *reward_config.custom, REWARD_MODEL) if c in scored]
        return publish(context, storage, catalog, staging, config=config.model_dump(), inputs=inputs,
                       metadata={**input_iteration(context.instance, rollouts), **reward_headline(scored, components)})


def reward_headline(scored: pd.DataFrame, components: list[str]) -> dict[str, float | int]:
    """An iteration's reward numbers, each its own series in the UI's Plots: the mix's mean/std/min/max, each
    component's mean (rule vs reward model vs custom), the mean per prompt category."""
    reward = scored["reward"]
    numbers = {"samples": len(scored), "mean_reward": float(reward.mean()), "reward_std": float(reward.std(ddof=0)),
               "reward_min": float(reward.min()), "reward_max": float(reward.max())}
    numbers.update({f"mean_reward/{name}": float(scored[name].mean()) for name in components})
    if OVERLONG_PENALTY in scored:  # DAPO's soft overlong punishment: how many paid it, and how much
        numbers.update({"overlong/penalised": int((scored[OVERLONG_PENALTY] < 0).sum()),
                        "overlong/mean_penalty": float(scored[OVERLONG_PENALTY].mean())})
    by_category = scored.groupby(scored["category"].fillna("none"))["reward"].mean()
    numbers.update({f"mean_reward_by_category/{category}": float(mean) for category, mean in by_category.items()})
    return numbers


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.rl.advantages", "batchrl.training.algos",
                                                    "batchrl.training.rewards.kl_in_reward", "batchrl.training.rl.remax",
                                                    "batchrl.training.models.value_model", "batchrl.resources.rl_recipe",
                                                    config=AdvantageConfig),
          kinds={"pytorch"}, ins={"promoted_policy": PROMOTED_POLICY_IN,
                                  "reward_model": dg.AssetIn(metadata={OPTIONAL_KEY: True})},
          metadata=declared_files(table="advantages.parquet"))
def advantages(context: dg.AssetExecutionContext, config: AdvantageConfig, rewards: Artifact, base_model: Artifact,
               promoted_policy: Optional[Artifact], reward_model: Optional[Artifact], rl_recipe: RLRecipe,
               storage: StorageResource, catalog: CatalogResource, compute: ComputeResource,
               trainer: TrainerLauncherResource) -> dg.Output:
    """Per-token advantages and returns from the recipe's estimator (grouped by prompt), with the KL to the base
    model in the token rewards when the recipe places it there (on the environment's compute: in
    process on the CPU, a job on the GPU host — the models it may run, reference and critic, and torch stay
    out of the Dagster process there)."""
    import pyarrow.parquet as pq

    settings = advantage_settings(config, rl_recipe)
    columns = pq.read_schema(rewards.file()).names
    kl_inputs, extra_inputs = kl_in_reward_inputs(context, storage, settings, columns, base_model, promoted_policy)
    critic_config, critic_lineage = critic_inputs(storage, settings, rewards, reward_model)  # RM: critic_init
    extra_inputs.update(critic_lineage)
    with storage.staging_dir("advantages_work") as workdir, storage.staging_dir("advantages") as staging:
        result = compute.run(context, trainer, "advantages", {
            "rewards_parquet": rewards.file(), "settings": settings.model_dump(), **kl_inputs, **critic_config,
            "device": compute.device, "out_parquet": output_file(context, staging)}, workdir=workdir,
            uses_models=bool(kl_inputs or critic_config))
        metrics = result["metrics"]
        if metrics.get("dynamic_sampling/all_groups_identical"):
            context.log.warning(f"advantages: {ALL_GROUPS_KEPT_NOTE}")
            metrics = {**metrics, "dynamic_sampling": ALL_GROUPS_KEPT_NOTE}
        lineage_config = settings.model_dump()
        if settings.use_kl_in_reward:  # the controller's state, read back by the next iteration
            lineage_config["kl_ctrl_state"] = {k: metrics[k] for k in ("kl_coef_applied", "kl_coef_next")}
        return publish(context, storage, catalog, staging, config=lineage_config,
                       inputs={"rewards": rewards, **extra_inputs},
                       metadata={**input_iteration(context.instance, rewards), "samples": result["samples"],
                                 "estimator": settings.estimator, **metrics, "adv_abs_mean": result["adv_abs_mean"],
                                 # the KL coefficient in the token rewards this iteration (0: KL is a loss term)
                                 "kl_in_reward_coef": float(metrics.get("kl_coef_applied", 0.0))})


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.jobs.train_policy", "batchrl.training.algos",
                                                    "batchrl.resources.rl_recipe", config=PolicyRunConfig),
          kinds={"deepspeed"}, ins={"promoted_policy": PROMOTED_POLICY_IN})
def policy_checkpoint(context: dg.AssetExecutionContext, config: PolicyRunConfig, advantages: Artifact,
                      rollouts: Artifact, base_model: Artifact, promoted_policy: Optional[Artifact],
                      rl_recipe: RLRecipe, storage: StorageResource, catalog: CatalogResource,
                      trainer: TrainerLauncherResource, tracking: TrackingResource,
                      rollout_engine: RolloutEngineResource) -> dg.Output:
    """Clipped policy-gradient update (PPO/GRPO) with KL to the base model, on DeepSpeed via Pipes, of the
    policy the rollouts were sampled from (its parent: the promoted checkpoint, or the base model on a new
    chain); the new checkpoint is promoted, so the next iteration samples from it (with ``rollouts.sample_ahead``
    the update's job has sampled it already, while it exported the checkpoint)."""
    parent = parent_policy(rollouts, promoted_policy, base_model)
    update = policy_config(config, rl_recipe)
    problem = materialised_advantages_problem(advantages.lineage.get("config", {}), rl_recipe)
    if problem:  # the advantages may come from an earlier run with another recipe, which no up-front check saw
        raise dg.Failure(problem)
    # a parent whose carried state retention removed: said before the job, not trained with a new AdamW unasked
    problem = update.carry_optimizer_state and carried_state_problem(parent.path, parent.asset, parent.data_version)
    if problem:
        raise dg.Failure(problem)
    critic_config, companions = critic_job_inputs(storage, advantages, update.critic)
    job_config = {
        "trainer": update.model_dump(),
        "batch_parquet": advantages.file(),
        "model_path": parent.path,
        "reference_model_path": base_model.path,
        **critic_config,
    }
    position = next_iteration(context.instance, parent)
    ahead, ahead_state = sample_ahead_request(storage, rollout_engine, trainer, rollouts, parent,
                                              context.asset_key.to_user_string(), context.run.tags, rl_recipe)
    own = {"kl_loss_coef": update.kl_loss_coef}
    # the chain so far against its iteration, drawn while the update runs
    with ChainChart(context, position[CHAIN], position.get(ITERATION), {"policy_checkpoint": own}) as chart:
        output = train_and_publish(context, "train_policy", job_config,
                                   {"advantages": advantages, "policy": parent, "reference": base_model},
                                   update.seed, storage, catalog, trainer, companions=companions, tracking=tracking,
                                   # requested, the job reports whether it sampled ahead
                                   metadata={**position, **own, **({} if ahead else {"sample_ahead": ahead_state})},
                                   job_extras={"sample_ahead": ahead} if ahead else None)
    promote(context, output, parent, base_model, extra=chart.metadata())
    return output
