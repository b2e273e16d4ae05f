"""The Dagster code location: `dagster dev` (workspace.yaml) and `dagster asset materialize -m batchrl.definitions`.

Resources are chosen per environment by ``BATCHRL_ENV`` (local | s3 | gpu), one mapping each; a
profile (``BATCHRL_PROFILE``, see ``batchrl.profiles``) overrides fields of them.
"""
from __future__ import annotations

import importlib.util
import os

import dagster as dg

from batchrl.assets import automation, data, dpo, evaluation, models, policy_chain, rl
from batchrl.resources import (
    ArtifactIOManager, CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
    TrainerLauncherResource,
)



def _storage_root() -> str:
    return os.path.abspath(os.environ.get("BATCHRL_STORAGE", ".storage"))


def _local() -> dict:
    root = _storage_root()
    return {
        "storage": StorageResource(root=root, cache_dir=os.path.join(root, "_cache")),
        "catalog": CatalogResource(path=os.path.join(root, "catalog.duckdb")),
        "landing": LandingResource(),
        "rollout_engine": RolloutEngineResource(),
        "trainer": TrainerLauncherResource(),
        "compute": ComputeResource(),
    }


def _s3() -> dict:
    options = {"client_kwargs": {"endpoint_url": os.environ["BATCHRL_S3_ENDPOINT"]}} \
        if os.environ.get("BATCHRL_S3_ENDPOINT") else {}
    landing = os.environ.get("BATCHRL_LANDING", "")
    return {**_local(),
            "storage": StorageResource(root=os.environ.get("BATCHRL_S3_ROOT", "s3://batchrl/artifacts"),
                                       storage_options=options,
                                       cache_dir=os.path.join(_storage_root(), "_cache")),
            "landing": LandingResource(preferences=f"{landing}/preferences", scored=f"{landing}/scored",
                                       prompts=f"{landing}/arith/train.jsonl",
                                       eval_prompts=f"{landing}/arith/eval.jsonl", storage_options=options)
            if landing else LandingResource()}


def _gpu() -> dict:
    """Every model stage on CUDA in bf16, each in a Pipes subprocess like the trainers (the Dagster process
    holds no GPU memory between assets); rollouts with vLLM where it is installed, else the static-cache
    engine (``BATCHRL_ROLLOUT_ENGINE`` forces one); evaluation decodes with the static-cache engine."""
    engine = os.environ.get("BATCHRL_ROLLOUT_ENGINE") or ("vllm" if importlib.util.find_spec("vllm") else "static")
    return {**_local(),
            "rollout_engine": RolloutEngineResource(kind=engine, device="cuda", dtype="bfloat16", in_subprocess=True),
            # BATCHRL_JOB_BACKEND=worker: one-process jobs in a long-lived warm worker (resources/job_worker.py)
            "trainer": TrainerLauncherResource(num_gpus=int(os.environ.get("BATCHRL_NUM_GPUS", "1")),
                                               backend=os.environ.get("BATCHRL_JOB_BACKEND", "subprocess")),
            "compute": ComputeResource(device="cuda", dtype="bfloat16", generation_engine="static", in_subprocess=True)}


RESOURCES_BY_ENV = {"local": _local, "s3": _s3, "gpu": _gpu}


def build_definitions(resources: dict | None = None) -> dg.Definitions:
    """The code location; ``resources`` overrides the environment's (tests pass their own). Assets hand each
    other artifacts through ``ArtifactIOManager`` on the same storage, unless ``resources`` has an io_manager."""
    resources = resources or environment_resources()
    resources = {"io_manager": ArtifactIOManager(storage=resources["storage"]), **resources}
    return dg.Definitions(
        assets=[*dg.load_assets_from_modules([data, models, rl, dpo, evaluation]), policy_chain.promoted_policy],
        asset_checks=dg.load_asset_checks_from_modules([data]),
        jobs=[automation.retrain_job, automation.ingest_job, *_profile_jobs()],
        sensors=[automation.new_logs_sensor],
        schedules=[automation.nightly_retrain],
        resources=resources,
    )


def _profile_jobs() -> list:
    """With ``BATCHRL_PROFILE`` set, a job ``<profile>_profile`` runs every asset with the profile's run
    config, so the UI launches it in one click (the launchpad shows the config, editable)."""
    from batchrl.profiles import load_profile

    name = os.environ.get("BATCHRL_PROFILE")
    if not name:
        return []
    profile = load_profile(name)
    job_name = "".join(c if c.isalnum() else "_" for c in os.path.basename(name).removesuffix(".yaml"))
    return [dg.define_asset_job(f"{job_name}_profile", selection=dg.AssetSelection.all(),
                                config={"ops": profile["ops"]} if profile["ops"] else None,
                                description=profile["description"])]


def environment_resources(env: str | None = None, profile: str | None = None) -> dict:
    """The resources of ``env`` (default ``BATCHRL_ENV``) with ``profile``'s (default ``BATCHRL_PROFILE``) overrides."""
    from batchrl.profiles import apply_resource_overrides, load_profile

    env = env or os.environ.get("BATCHRL_ENV", "local")
    resources = RESOURCES_BY_ENV[env]()
    profile = profile or os.environ.get("BATCHRL_PROFILE")
    return apply_resource_overrides(resources, load_profile(profile, env)["resources"]) if profile else resources


def selected_job(defs: dg.Definitions, selection: list[str] | None = None) -> dg.JobDefinition:
    """The implicit asset job, cut to ``selection`` (default: every asset, with its checks)."""
    job = defs.resolve_implicit_global_asset_job_def()
    if selection:
        keys = dg.AssetSelection.assets(*selection).resolve(defs.resolve_asset_graph())
        job = job.get_subset(asset_selection=set(keys))
    return job


def execute_assets(defs: dg.Definitions, instance: dg.DagsterInstance, selection: list[str] | None = None,
                   run_config: dict | None = None, **execute_kwargs) -> dg.ExecuteInProcessResult:
    """Materialise ``selection`` (default: every asset, with its checks) in this process, after the
    whole-run config checks (``assets.rl_config``: an impossible combination fails before anything runs;
    ``execute_kwargs``: ``run_id``, ``tags`` of ``execute_in_process``)."""
    from batchrl.assets.rl_config import check_rl_run_config

    check_rl_run_config(run_config, selection)
    return selected_job(defs, selection).execute_in_process(instance=instance, run_config=run_config or {},
                                                            raise_on_error=False, **execute_kwargs)


defs = build_definitions()
