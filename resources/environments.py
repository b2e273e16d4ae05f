"""The resources of each environment (``BATCHRL_ENV``: local | s3 | gpu | ray), one mapping each; a profile
(``BATCHRL_PROFILE``, see ``resources.profiles``) overrides fields of them."""
from __future__ import annotations

import importlib.util
import os

from batchrl.common.storage_layout import cache_dir_of, catalog_path_of, local_storage_root
from batchrl.resources import (
    CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource, TrackingResource,
    TrainerLauncherResource,
)
from batchrl.resources.profiles import apply_run_overrides


def _landing(storage_options: dict | None = None) -> LandingResource:
    """``BATCHRL_LANDING`` (a folder or ``s3://`` prefix laid out as ``resources.landing.LAYOUT``: ``preferences/``,
    ``scored/``, ``feedback/``, ``arith/{train,eval}.jsonl``): where the team's logs land, every location under it
    (one missing fails the assets that read it, never falls back to the samples); unset: the shipped samples."""
    landing = os.environ.get("BATCHRL_LANDING", "")
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
    }


def _tracking() -> TrackingResource:
    """MLflow tracking of the training assets, off unless ``BATCHRL_MLFLOW_URI`` names a tracking server (or a
    ``sqlite:///`` store); ``BATCHRL_MLFLOW_EXPERIMENT`` names the experiment (default batchrl, also the W&B
    project); W&B offline runs, off unless ``BATCHRL_WANDB_DIR`` names a folder for them."""
    return TrackingResource(mlflow_uri=os.environ.get("BATCHRL_MLFLOW_URI", ""),
                            experiment=os.environ.get("BATCHRL_MLFLOW_EXPERIMENT", "batchrl"),
                            wandb_dir=os.environ.get("BATCHRL_WANDB_DIR", ""))


def _s3() -> dict:
    options = {"client_kwargs": {"endpoint_url": os.environ["BATCHRL_S3_ENDPOINT"]}} \
        if os.environ.get("BATCHRL_S3_ENDPOINT") else {}
    return {**_local(),
            "storage": StorageResource(root=os.environ.get("BATCHRL_S3_ROOT", "s3://batchrl/artifacts"),
                                       storage_options=options,
                                       cache_dir=cache_dir_of(local_storage_root())),
            "landing": _landing(options)}


def _gpu() -> dict:
    """Every model stage on CUDA in bf16, each in a Pipes job like the trainers (the Dagster process holds no
    GPU memory between assets; one-process jobs share a warm worker that empties its cache after each job);
    rollouts with vLLM where it is installed, else the static-cache engine (``BATCHRL_ROLLOUT_ENGINE`` forces
    one); evaluation decodes with the static-cache engine."""
    engine = os.environ.get("BATCHRL_ROLLOUT_ENGINE") or ("vllm" if importlib.util.find_spec("vllm") else "static")
    return {**_local(),
            "rollout_engine": RolloutEngineResource(kind=engine, device="cuda", dtype="bfloat16", in_subprocess=True),
            # one-process jobs in a long-lived warm job worker (resources/job_worker.py): fresh processes paid
            # imports + CUDA context per stage (bench/RESULTS.md); BATCHRL_JOB_BACKEND=subprocess for those
            "trainer": TrainerLauncherResource(num_gpus=int(os.environ.get("BATCHRL_NUM_GPUS", "1")),
                                               backend=os.environ.get("BATCHRL_JOB_BACKEND", "worker"),
                                               # two jobs share the GPU when a run overlaps steps
                                               gpu_job_slots=int(os.environ.get("BATCHRL_GPU_JOB_SLOTS", "2")),
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
    over ``BATCHRL_RAY_ROLLOUT_REPLICAS`` replicas (1); the jobs' files travel through the storage root."""
    from batchrl.resources.ray_launch import RayJobs

    base = _s3()
    gpus = float(os.environ.get("BATCHRL_RAY_GPUS_PER_RANK", "0"))
    device = {"device": "cuda", "dtype": "bfloat16"} if gpus else {}
    ray = RayJobs(address=os.environ.get("BATCHRL_RAY_ADDRESS", "http://127.0.0.1:8265"),
                  world_size=int(os.environ.get("BATCHRL_RAY_WORLD_SIZE", "2")),
                  rollout_replicas=int(os.environ.get("BATCHRL_RAY_ROLLOUT_REPLICAS", "1")), gpus_per_rank=gpus,
                  placement_strategy=os.environ.get("BATCHRL_RAY_PLACEMENT", "PACK"),
                  storage_root=base["storage"].root, storage_options=base["storage"].storage_options)
    return {**base,
            "rollout_engine": RolloutEngineResource(in_subprocess=True, **device),
            "trainer": TrainerLauncherResource(backend="ray", ray=ray, num_gpus=int(gpus)),
            "compute": ComputeResource(in_subprocess=True, **device)}


RESOURCES_BY_ENV = {"local": _local, "s3": _s3, "gpu": _gpu, "ray": _ray}

def environment_resources(env: str | None = None, profile: str | None = None) -> dict:
    """The resources of ``env`` (default ``BATCHRL_ENV``) with ``profile``'s (default ``BATCHRL_PROFILE``) overrides,
    then those of `batchrl run`'s ``-c`` files (``resources.profiles.apply_run_overrides``)."""
    env = env or os.environ.get("BATCHRL_ENV", "local")
    resources = RESOURCES_BY_ENV[env]()
    profile = profile or os.environ.get("BATCHRL_PROFILE")
    return apply_run_overrides(resources, env, profile)
