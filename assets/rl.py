"""RL assets: prompts → rollouts → rewards → advantages → policy_checkpoint."""

import os

import dagster as dg
import pandas as pd
from pydantic import Field

from batchrl import fsutil
from batchrl.assets.common import (
    as_ref, code_version, publish, run_config_for, to_library_config, train_and_publish,
)
from batchrl.assets.models import read_parquet_in
from batchrl.assets.rl_algorithm import check_kl_in_reward, critic_job_inputs, kl_in_reward_inputs, with_critic_values
from batchrl.resources import (
    ArtifactRef, CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
    TrainerLauncherResource,
)
from batchrl.training.advantages import AdvantageSettings
from batchrl.training.prompts import load_prompts
from batchrl.training.rewards import RewardConfig
from batchrl.training.trainer.config import PolicyConfig

RewardRunConfig = run_config_for(RewardConfig, "RewardRunConfig")
PolicyRunConfig = run_config_for(PolicyConfig, "PolicyRunConfig")


class PromptsConfig(dg.Config):
    """``field_mapping``: ``{source field (dotted path into nested records): prompt field}``, e.g. verl
    Parquet ``{"reward_model.ground_truth": "answer"}``, GSM8K ``{"question": "prompt"}``."""

    field_mapping: dict[str, str] = Field(default_factory=dict)


class RolloutConfig(dg.Config):
    """``policy``: "latest" samples from the last policy_checkpoint of this base model's chain (the
    base model itself when the chain is new); "base" always samples from the base model.
    ``max_prompts``: a sample of that many prompts drawn with ``seed`` (all prompts when unset)."""

    policy: str = "latest"
    samples_per_prompt: int = 8
    max_prompts: int | None = None
    seed: int = 0
    greedy_baseline: bool = Field(False, description="also decode one greedy response per prompt; its reward "
                                  "becomes the prompt's baseline (ReMax, advantages.estimator: remax)")


AdvantageConfig = run_config_for(AdvantageSettings, "AdvantageConfig")


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.prompts"), kinds={"parquet"})
def prompts(context: dg.AssetExecutionContext, config: PromptsConfig, landing: LandingResource,
            storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Rollout prompts (with gold answers for the rule reward), checked at the boundary."""
    table = load_prompts(landing.prompts, landing.storage_options, mapping=config.field_mapping)
    fs, path = fsutil.filesystem_for(landing.prompts, landing.storage_options)
    source = {"uri": landing.prompts, "sha256": fsutil.sha256_file(fs, path)}
    with storage.staging_dir("prompts") as staging:
        table.to_parquet(os.path.join(staging, "prompts.parquet"), index=False)
        return publish(context, storage, catalog, staging,
                       config={"landing": landing.prompts, "field_mapping": config.field_mapping},
                       input_files=[source],
                       metadata={"rows": len(table), "categories": table["category"].value_counts().to_dict()})


def _selected_assets(context: dg.AssetExecutionContext) -> list[str] | None:
    keys = context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys
    return [key.to_user_string() for key in keys] if keys else None


def chain_base(storage: StorageResource, policy: ArtifactRef) -> str:
    """Data version of the base model a policy descends from (a base model is its own chain base)."""
    if policy.asset == "base_model":
        return policy.data_version
    return storage.read_lineage(policy)["inputs"]["reference"]["data_version"]


def _current_policy(context: dg.AssetExecutionContext, storage: StorageResource, base_model: dict,
                    choice: str) -> ArtifactRef:
    """A policy chain belongs to one base model: the latest policy_checkpoint is used only when it was
    trained from this base model; a new base model starts a new chain from itself."""
    base = as_ref(base_model)
    if choice == "latest":
        event = context.instance.get_latest_materialization_event(dg.AssetKey("policy_checkpoint"))
        if event is not None and event.asset_materialization is not None:
            meta = event.asset_materialization.metadata
            latest = ArtifactRef("policy_checkpoint", meta["uri"].value, meta["data_version"].value)
            if chain_base(storage, latest) == base.data_version:
                return latest
            context.log.info(f"rollouts: latest policy_checkpoint {latest.data_version} belongs to another "
                             f"base model; starting a new chain from base_model {base.data_version}")
    elif choice != "base":
        raise dg.Failure(f"rollouts: policy must be 'latest' or 'base', got {choice!r}")
    return base


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.rollout", config=RolloutConfig), kinds={"pytorch"})
def rollouts(context: dg.AssetExecutionContext, config: RolloutConfig, prompts: dict, base_model: dict,
             rollout_engine: RolloutEngineResource, trainer: TrainerLauncherResource, storage: StorageResource,
             catalog: CatalogResource) -> dg.Output:
    """n sampled responses per prompt from the current policy, with token log-probs (plus one greedy
    response per prompt with ``greedy_baseline``, for ReMax)."""
    from batchrl.assets.rl_config import check_rl_run_config

    check_rl_run_config(context.run.run_config, _selected_assets(context))  # runs launched from the UI
    policy = _current_policy(context, storage, base_model, config.policy)
    table = read_parquet_in(storage, prompts, "prompts.parquet")
    if config.max_prompts and len(table) > config.max_prompts:  # a new seeded subset each iteration
        table = table.sample(config.max_prompts, random_state=config.seed).sort_index()
    with storage.staging_dir("rollouts_work") as workdir:
        samples, stats = rollout_engine.sample(context, trainer, model_path=storage.localize(policy),
                                               prompts=list(table["prompt"]), n=config.samples_per_prompt,
                                               seed=config.seed, workdir=workdir, cache_dir=storage.cache_dir)
        if config.greedy_baseline:
            from batchrl.training.remax import add_greedy_baselines, greedy_engine

            greedy_dir = os.path.join(workdir, "greedy")
            os.makedirs(greedy_dir, exist_ok=True)
            greedy, _ = greedy_engine(rollout_engine).sample(
                context, trainer, model_path=storage.localize(policy), prompts=list(table["prompt"]), n=1,
                seed=config.seed, workdir=greedy_dir, cache_dir=storage.cache_dir)
            samples = add_greedy_baselines(samples, greedy)
    meta = table.reset_index(drop=True).drop(columns=["prompt"])  # answer, category, data_source, tests ...
    samples = samples.join(meta, on="prompt_index")
    with storage.staging_dir("rollouts") as staging:
        samples.to_parquet(os.path.join(staging, "rollouts.parquet"), index=False)
        return publish(context, storage, catalog, staging, seed=config.seed,
                       config={**config.model_dump(), "engine": rollout_engine.model_dump()},
                       inputs={"prompts": prompts, "policy": policy},
                       metadata={"policy": policy.uri, **{k: v for k, v in stats.items() if k != "content_hash"}})


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.rewards"), kinds={"pytorch"})
def rewards(context: dg.AssetExecutionContext, config: RewardRunConfig, rollouts: dict, reward_model: dict,
            storage: StorageResource, catalog: CatalogResource, compute: ComputeResource,
            trainer: TrainerLauncherResource) -> dg.Output:
    """Rule reward + reward-model score per sample, mixed by weights (optionally routed by category)."""
    with storage.staging_dir("rewards_work") as workdir, storage.staging_dir("rewards") as staging:
        out = os.path.join(staging, "rewards.parquet")
        compute.run(context, trainer, "rewards", {
            "rollouts_parquet": os.path.join(storage.localize(rollouts), "rollouts.parquet"),
            "reward_config": to_library_config(config, RewardConfig).model_dump(),
            "reward_model_path": storage.localize(reward_model), "device": compute.device, "out_parquet": out},
            workdir=workdir)
        scored = pd.read_parquet(out)
        by_category = scored.groupby(scored["category"].fillna("none"))["reward"].mean().to_dict()
        return publish(context, storage, catalog, staging, config=config.model_dump(),
                       inputs={"rollouts": rollouts, "reward_model": reward_model},
                       metadata={"samples": len(scored), "mean_reward": float(scored["reward"].mean()),
                                 "mean_reward_by_category": by_category})


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.advantages", "batchrl.training.algos",
                                                    "batchrl.training.kl_reward", "batchrl.training.remax",
                                                    config=AdvantageConfig),
          kinds={"pytorch"})
def advantages(context: dg.AssetExecutionContext, config: AdvantageConfig, rewards: dict, base_model: dict,
               storage: StorageResource, catalog: CatalogResource, compute: ComputeResource) -> dg.Output:
    """Per-token advantages and returns from the configured estimator (grouped by prompt), with the
    KL to the base model in the token rewards when ``use_kl_in_reward``."""
    from batchrl.training.advantages import compute_advantages

    settings = to_library_config(config, AdvantageSettings)
    table = read_parquet_in(storage, rewards, "rewards.parquet")
    kl, extra_inputs = kl_in_reward_inputs(context, storage, compute, settings, table, base_model)
    table, critic_inputs = with_critic_values(storage, compute, settings, table, rewards)
    extra_inputs.update(critic_inputs)
    out = compute_advantages(table, settings.estimator, gamma=settings.gamma, lam=settings.lam,
                             norm_adv_by_std=settings.norm_adv_by_std, kl=kl)
    metrics = out.attrs.get("metrics", {})
    flat = [a for row in out["advantages"] for a in row]
    with storage.staging_dir("advantages") as staging:
        out.to_parquet(os.path.join(staging, "advantages.parquet"), index=False)
        lineage_config = settings.model_dump()
        if kl is not None:  # the controller's state, read back by the next iteration
            lineage_config["kl_ctrl_state"] = {k: metrics[k] for k in ("kl_coef_applied", "kl_coef_next")}
        return publish(context, storage, catalog, staging, config=lineage_config,
                       inputs={"rewards": rewards, **extra_inputs},
                       metadata={"samples": len(out), "estimator": settings.estimator, **metrics,
                                 "adv_abs_mean": float(pd.Series(flat).abs().mean()) if flat else 0.0})


@dg.asset(group_name="rl", code_version=code_version("batchrl.training.jobs.train_policy", "batchrl.training.algos"),
          kinds={"deepspeed"})
def policy_checkpoint(context: dg.AssetExecutionContext, config: PolicyRunConfig, advantages: dict,
                      rollouts: dict, base_model: dict, storage: StorageResource, catalog: CatalogResource,
                      trainer: TrainerLauncherResource) -> dg.Output:
    """Clipped policy-gradient update (PPO/GRPO) with KL to the base model, on DeepSpeed via Pipes."""
    policy = as_ref(storage.read_lineage(rollouts)["inputs"]["policy"])
    if chain_base(storage, policy) != as_ref(base_model).data_version:
        raise dg.Failure(f"policy_checkpoint: the rollouts were sampled from {policy.asset} {policy.data_version} "
                         f"({policy.uri}), which descends from another base model than the KL reference "
                         f"base_model {as_ref(base_model).data_version} ({as_ref(base_model).uri}): re-materialise "
                         "rollouts so the policy chain and its reference share one base model")
    check_kl_in_reward(storage, advantages, config.use_kl_in_reward, config.kl_coef)
    critic_config, companions = critic_job_inputs(storage, advantages, config.critic)
    job_config = {
        "trainer": config.model_dump(),
        "batch_parquet": os.path.join(storage.localize(advantages), "advantages.parquet"),
        "model_path": storage.localize(policy),
        "reference_model_path": storage.localize(base_model),
        **critic_config,
    }
    return train_and_publish(context, "train_policy", job_config,
                             {"advantages": advantages, "policy": policy, "reference": base_model},
                             config.seed, storage, catalog, trainer, companions=companions)
