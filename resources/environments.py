"""The resources of each environment (``BATCHRL_ENV``: local | s3 | gpu | ray), one mapping each; a profile
(``BATCHRL_PROFILE``, see ``resources.profiles``) overrides fields of them."""
from __future__ import annotations

import os

import dagster as dg

from batchrl.common.environment_variables import is_set, read
from batchrl.common.storage_layout import cache_dir_of, catalog_path_of, local_storage_root
from batchrl.resources import (
    CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource, TrackingResource,
    TrainerLauncherResource,
)
from batchrl.resources.profiles import apply_run_overrides
from batchrl.resources.rl_recipe import RLRecipe


def _landing(storage_options: dict | None = None) -> LandingResource:
    """``BATCHRL_LANDING`` (a folder or ``s3://`` prefix laid out as ``resources.landing.LAYOUT``: ``preferences/``,
    ``scored/``, ``feedback/``, ``arith/{train,eval}.jsonl``): where the team's logs land, every location under it
    (one missing fails the assets that read it, never falls back to the samples); unset: the shipped samples."""
    landing = read("BATCHRL_LANDING") or ""
    return LandingResource.under(landing, storage_options) if landing.rstrip("/") else LandingResource()


def _local() -> dict:
    root = local_storage_root()
    return {
        "storage": StorageResource(root=root, cache_dir=cache_dir_of(root)),
        "catalog": CatalogResource(path=catalog_path_of(root)),
        "landing": _landing(),
        "rollout_engine": RolloutEngineResource(),
        "trainer": TrainerLauncherResource(),
        "compute": ComputeResource(),
        "tracking": _tracking(),
        "rl_recipe": RLRecipe(),  # a profile's or -c file's resources.rl_recipe overrides its fields
    }


def _tracking() -> TrackingResource:
    """MLflow tracking of the training assets, off unless ``BATCHRL_MLFLOW_URI`` names a tracking server (or a
    ``sqlite:///`` store); ``BATCHRL_MLFLOW_EXPERIMENT`` names the experiment (default batchrl, also the W&B
    project); W&B offline runs, off unless ``BATCHRL_WANDB_DIR`` names a folder for them. Each one set is a
    ``dg.EnvVar``: Dagster resolves it when it builds the resource (a URI's credentials stay out of the UI)."""
    fields = {"mlflow_uri": "BATCHRL_MLFLOW_URI", "experiment": "BATCHRL_MLFLOW_EXPERIMENT",
              "wandb_dir": "BATCHRL_WANDB_DIR"}
    return TrackingResource(**{field: _dagster_env_var(name) for field, name in fields.items() if is_set(name)})


def _dagster_env_var(name: str) -> dg.EnvVar:
    """``dg.EnvVar(name)``, its value checked now (a bad one fails naming it, before Dagster resolves it)."""
    read(name)
    return dg.EnvVar(name)


def _s3() -> dict:
    endpoint = read("BATCHRL_S3_ENDPOINT")
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {**_local(),
            "storage": StorageResource(root=read("BATCHRL_S3_ROOT"),
                                       storage_options=options,
                                       cache_dir=cache_dir_of(local_storage_root())),
            "landing": _landing(options)}


def _gpu() -> dict:
    """Every model stage on CUDA in bf16, each in a Pipes job like the trainers (the Dagster process holds no
    GPU memory between assets; one-process jobs share a warm worker that empties its cache after each job);
    rollouts with the static-cache engine, installed vLLM or not: measured faster at the GSM8K profile's size than
    vLLM, resident or fresh per step (bench/RESULTS.md); ``BATCHRL_ROLLOUT_ENGINE=vllm`` chooses vLLM, kept in the
    job worker (asleep between steps, each checkpoint loaded in place). Evaluation decodes with the static-cache
    engine."""
    engine = read("BATCHRL_ROLLOUT_ENGINE") or "static"
    return {**_local(),
            "rollout_engine": RolloutEngineResource(kind=engine, device="cuda", dtype="bfloat16", in_subprocess=True,
                                                    vllm_resident=engine == "vllm"),
            # one-process jobs in a long-lived warm job worker (resources/job_worker.py): fresh processes paid
            # imports + CUDA context per stage (bench/RESULTS.md); BATCHRL_JOB_BACKEND=subprocess for those
            "trainer": TrainerLauncherResource(num_gpus=read("BATCHRL_NUM_GPUS"),
                                               backend=read("BATCHRL_JOB_BACKEND"),
                                               # two jobs share the GPU when a run overlaps steps
                                               gpu_job_slots=read("BATCHRL_GPU_JOB_SLOTS"),
                                               env=_job_env(cache_dir_of(local_storage_root()))),
            "compute": ComputeResource(device="cuda", dtype="bfloat16", generation_engine="static", in_subprocess=True)}


def _job_env(cache_dir: str) -> dict[str, str]:
    """The GPU jobs' environment: compile caches, and tokenizers on every core (the console turns that off for
    its own process; a job tokenising 4,096 rollouts single-threaded idled the GPU ~4 s on the H200)."""
    return {**_compile_caches(cache_dir), "TOKENIZERS_PARALLELISM": "true"}


def _compile_caches(cache_dir: str) -> dict[str, str]:
    """torch.compile's inductor cache and Triton's kernel cache beside the storage (like vLLM's): a retrain on
    new logs, or a job in a fresh pod that mounts the cache, reuses the compiled kernels instead of paying the
    compile again (a variable already set in the environment wins)."""
    wanted = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "torch", "inductor"),
              "TRITON_CACHE_DIR": os.path.join(cache_dir, "torch", "triton")}
    return {key: os.environ.get(key, path) for key, path in wanted.items()}


def _ray() -> dict:
    """``s3``'s storage, every model stage a Pipes job on the Ray cluster at ``BATCHRL_RAY_ADDRESS`` (its dashboard,
    default http://127.0.0.1:8265; docs/SCALE_OUT.md): training over ``BATCHRL_RAY_WORLD_SIZE`` ranks (default 2,
    ``BATCHRL_RAY_GPUS_PER_RANK`` GPUs each, 0: a CPU slot and gloo), placed ``BATCHRL_RAY_PLACEMENT`` (PACK), rollouts
    over ``BATCHRL_RAY_ROLLOUT_REPLICAS`` replicas (1), one-process jobs in each node's resident job worker
    (``BATCHRL_RAY_RESIDENT_IDLE_S``), each job a Ray job of its own or, with ``BATCHRL_RAY_DRIVER_IDLE_S`` > 0,
    handed to a driver resident on the cluster; the jobs' files travel through the storage root."""
    from batchrl.resources.ray_launch import RayJobs

    base = _s3()
    gpus = read("BATCHRL_RAY_GPUS_PER_RANK")
    device = {"device": "cuda", "dtype": "bfloat16"} if gpus else {}
    ray = RayJobs(address=read("BATCHRL_RAY_ADDRESS"), world_size=read("BATCHRL_RAY_WORLD_SIZE"),
                  rollout_replicas=read("BATCHRL_RAY_ROLLOUT_REPLICAS"), gpus_per_rank=gpus,
                  cpus_per_rank=read("BATCHRL_RAY_CPUS_PER_RANK"),
                  placement_strategy=read("BATCHRL_RAY_PLACEMENT"),
                  resident_worker_idle_s=read("BATCHRL_RAY_RESIDENT_IDLE_S"),
                  resident_driver_idle_s=read("BATCHRL_RAY_DRIVER_IDLE_S"),
                  storage_root=base["storage"].root, storage_options=base["storage"].storage_options)
    return {**base,
            "rollout_engine": RolloutEngineResource(in_subprocess=True, **device),
            "trainer": TrainerLauncherResource(backend="ray", ray=ray, num_gpus=int(gpus)),
            "compute": ComputeResource(in_subprocess=True, **device)}


RESOURCES_BY_ENV = {"local": _local, "s3": _s3, "gpu": _gpu, "ray": _ray}

def environment_resources(env: str | None = None, profile: str | None = None) -> dict:
    """The resources of ``env`` (default ``BATCHRL_ENV``) with ``profile``'s (default ``BATCHRL_PROFILE``) overrides,
    then those of `batchrl run`'s ``-c`` files (``resources.profiles.apply_run_overrides``)."""
    env = env or read("BATCHRL_ENV")
    resources = RESOURCES_BY_ENV[env]()
    profile = profile or read("BATCHRL_PROFILE")
    return apply_run_overrides(resources, env, profile)
