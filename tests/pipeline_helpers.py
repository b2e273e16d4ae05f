"""Shared helpers for the Dagster-level tests: resources on a temp storage root, run the asset graph."""
from __future__ import annotations

import os
import signal

import dagster as dg

from batchrl.assets.rollout_prefetch import NEXT_ROLLOUTS_SEED_TAG
from batchrl.common.storage_layout import cache_dir_of, catalog_path_of
from batchrl.definitions import build_definitions
from batchrl.resources import (
    CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
    TrainerLauncherResource,
)
from batchrl.runs.execute import execute_assets

# one RL iteration's assets, and what they need materialised first (the data path and the base model)
RL_LOOP = ["rollouts", "rewards", "advantages", "policy_checkpoint"]
UPSTREAM = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "base_model"]
TINY_BASE = {"ops": {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}}}}


def recipe(**fields) -> dict:
    """A run config's ``resources`` block setting RL recipe fields (``resources.rl_recipe``), as the launchpad does."""
    return {"rl_recipe": {"config": fields}}


def local_resources(root: str, landing: LandingResource | None = None, **overrides) -> dict:
    return {
        "storage": StorageResource(root=root, cache_dir=cache_dir_of(root)),
        "catalog": CatalogResource(path=catalog_path_of(root)),
        "landing": landing or LandingResource(),
        "rollout_engine": RolloutEngineResource(),
        "trainer": TrainerLauncherResource(),
        "compute": ComputeResource(),
        **overrides,
    }


def run_assets(resources: dict, instance: dg.DagsterInstance, selection: list[str] | None = None,
               run_config: dict | None = None, tags: dict | None = None) -> dg.ExecuteInProcessResult:
    return execute_assets(build_definitions(resources), instance, selection, run_config,
                          **({"tags": tags} if tags else {}))


def latest_metadata(instance: dg.DagsterInstance, asset: str) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    assert event is not None, f"{asset} was not materialised"
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def stop_workers(histories: dict) -> None:
    """SIGTERM every job worker named in ``histories`` ({name: {stage: [metadata, ...]}}): the jobs' own and the
    off-policy rollouts' worker."""
    pids = {m.get(key) for history in histories.values() for records in history.values() for m in records
            for key in ("worker_pid", "prefetch_worker_pid")} - {None}
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass


# a tiny model and a small RL iteration: the resident-loop tests and bench/check_resident_trainer_gpu.py
SMALL = {"ops": {
    "base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
    "rollouts": {"config": {"max_prompts": 8}},
    "rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.0}}},
    "policy_checkpoint": {"config": {"micro_batch_size": 4}},  # 4 optimiser steps an iteration
}, "resources": recipe(samples_per_prompt=2)}


def worker_resources(root: str, rollouts_in_worker: bool = True, env: dict | None = None) -> dict:
    """Resources with every model stage a job in the warm worker (as on a GPU host; ``env`` on top of its settings),
    the rollouts sampled by the job worker or in the Dagster process."""
    return local_resources(
        root, rollout_engine=RolloutEngineResource(in_subprocess=rollouts_in_worker),
        trainer=TrainerLauncherResource(backend="worker", worker_idle_s=60, env={"BATCHRL_STORAGE": root, **(env or {})}))


def rl_history(instance: dg.DagsterInstance, limit: int = 10) -> dict[str, list[dict]]:
    """Per RL stage, each materialisation's metadata (oldest first, the last ``limit``)."""
    return {stage: [{k: getattr(v, "value", v) for k, v in r.asset_materialization.metadata.items()}
                    for r in reversed(instance.fetch_materializations(dg.AssetKey(stage), limit=limit).records)]
            for stage in RL_LOOP}


def two_rl_iterations(root: str, home: str, cache_gb: str, run_config: dict = SMALL, env: dict | None = None,
                      upstream_built: bool = False) -> dict[str, list[dict]]:
    """Two RL iterations with every model stage a job in the warm worker (as on a GPU host), its weight cache at
    ``cache_gb`` (and ``env``): per RL stage, each materialisation's metadata (oldest first). ``upstream_built``:
    the root and home already hold the upstream assets (the ``upstream_copy`` fixture's)."""
    resources = worker_resources(root, env={"BATCHRL_WEIGHT_CACHE_GB": cache_gb, **(env or {})})
    os.makedirs(home, exist_ok=True)
    with dg.DagsterInstance.local_temp(home) as instance:
        if not upstream_built:
            assert run_assets(resources, instance, UPSTREAM, run_config).success
        for _ in range(2):  # each update promotes its checkpoint: the next rollouts sample from it
            assert run_assets(resources, instance, RL_LOOP, run_config).success
        return rl_history(instance)


def seeded_rl_iterations(root: str, home: str, run_config: dict, iterations: int, rollouts_in_worker: bool,
                         env: dict | None = None, before=None) -> dict[str, list[dict]]:
    """``iterations`` RL iterations on the upstream assets in ``root`` and ``home`` (the ``upstream_copy``
    fixture's), numbered and announced as ``batchrl run --rl-iterations`` does (iteration i samples with seed i; a
    run tagged with the next one's seed, ``cli.run_command.announced_next``), every
    training stage a job in the warm worker (``env`` on top of its settings); the rollouts sampled by the job worker
    or in the Dagster process (``before(seed)``: called before each): per RL stage and the base model, each
    materialisation's metadata (oldest first)."""
    resources = worker_resources(root, rollouts_in_worker, env)
    ops = run_config["ops"]
    with dg.DagsterInstance.local_temp(home) as instance:
        for seed in range(iterations):
            if before is not None:
                before(seed)
            rollouts = {"config": {**ops["rollouts"]["config"], "seed": seed}}
            following = {NEXT_ROLLOUTS_SEED_TAG: str(seed + 1)} if seed + 1 < iterations else {}
            assert run_assets(resources, instance, RL_LOOP, {**run_config, "ops": {**ops, "rollouts": rollouts}},
                              following).success
        history = rl_history(instance)
        history["base_model"] = [latest_metadata(instance, "base_model")]
        return history
