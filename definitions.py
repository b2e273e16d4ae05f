"""The Dagster code location: `dagster dev` (workspace.yaml) and `dagster asset materialize -m batchrl.definitions`.

Resources are chosen per environment by ``BATCHRL_ENV`` (local | s3 | gpu), one mapping each; a
profile (``BATCHRL_PROFILE``, see ``batchrl.resources.profiles``) overrides fields of them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import uuid

import dagster as dg

from batchrl.runs import step_server
from batchrl.assets import automation, data, dpo, evaluation, models, offline, policy_chain, rl
from batchrl.assets.data import DROP_CONTENT_TAG
from batchrl.assets.drops import DROP_OP, landing_drops
from batchrl.lineage.code_versions import cache_dir_of, catalog_path_of, local_storage_root
from batchrl.resources import (
    ArtifactIOManager, CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
    TrainerLauncherResource,
)


@dg.configured(dg.multiprocess_executor, config_schema={"max_concurrent": dg.Field(
    int, default_value=0, description="steps that may run at once (0: one per CPU core)")})
def step_executor(config: dict) -> dict:
    """Dagster's multiprocess executor with its step processes forked from ``batchrl.runs.step_server``."""
    return {"max_concurrent": config["max_concurrent"],
            "start_method": {"forkserver": {"preload_modules": step_server.PRELOAD}}}


def _landing(storage_options: dict | None = None) -> LandingResource:
    """``BATCHRL_LANDING`` (a folder or ``s3://`` prefix holding ``preferences/``, ``scored/`` and
    ``arith/{train,eval}.jsonl``): where the team's logs land; unset: the shipped samples."""
    landing = os.environ.get("BATCHRL_LANDING", "").rstrip("/")
    if not landing:
        return LandingResource()
    return LandingResource(preferences=f"{landing}/preferences", scored=f"{landing}/scored",
                           prompts=f"{landing}/arith/train.jsonl", eval_prompts=f"{landing}/arith/eval.jsonl",
                           storage_options=storage_options or {})


def _local() -> dict:
    root = local_storage_root()
    return {
        "storage": StorageResource(root=root, cache_dir=cache_dir_of(root)),
        "catalog": CatalogResource(path=catalog_path_of(root)),
        "landing": _landing(),
        "rollout_engine": RolloutEngineResource(),
        "trainer": TrainerLauncherResource(),
        "compute": ComputeResource(),
    }


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


RESOURCES_BY_ENV = {"local": _local, "s3": _s3, "gpu": _gpu}


def build_definitions(resources: dict | None = None, dpo_self_play: bool | None = None) -> dg.Definitions:
    """The code location; ``resources`` overrides the environment's (tests pass their own). Assets hand each
    other artifacts through ``ArtifactIOManager`` on the same storage, unless ``resources`` has an io_manager.
    ``dpo_self_play``: the DPO path may take self-play pairs (default ``dpo_takes_self_play_pairs()``)."""
    resources = resources or environment_resources()
    resources = {"io_manager": ArtifactIOManager(storage=resources["storage"]), **resources}
    self_play = dpo_takes_self_play_pairs() if dpo_self_play is None else dpo_self_play
    return dg.Definitions(
        assets=[*dg.load_assets_from_modules([data, models, rl, dpo, evaluation, offline]), dpo.dpo_pairs_asset(self_play),
                policy_chain.promoted_policy],
        asset_checks=dg.load_asset_checks_from_modules([data]),
        jobs=[automation.retrain_job, automation.ingest_job, *_profile_jobs()],
        sensors=[automation.new_logs_sensor],
        schedules=[automation.nightly_retrain],
        executor=step_executor,
        resources=resources,
    )


def steps_run_models(definitions: dg.Definitions) -> bool:
    """Whether a step process runs model code itself (rollouts or model inference in process, the CPU
    environments), so the step server preloads torch for it; on the GPU host every model stage is a job and
    torch stays out of the step processes (its import held the first steps back: bench/RESULTS.md)."""
    resources = definitions.resources
    return not (resources["rollout_engine"].in_subprocess and resources["compute"].in_subprocess)


def dpo_takes_self_play_pairs() -> bool:
    """Whether this code location's DPO path may take pairs from the policy's scored samples (``dpo_pairs``
    then has a ``rewards`` input): ``BATCHRL_DPO_SELF_PLAY`` (1 or 0), else whether the profile
    (``BATCHRL_PROFILE``) gives ``dpo_pairs`` the source self or both. Off (the default), the DPO path depends on
    the logged pairs alone and runs beside the RL branch; `batchrl run` turns it on when its run config asks."""
    from batchrl.resources.profiles import dpo_self_play, load_profile

    explicit = os.environ.get("BATCHRL_DPO_SELF_PLAY")
    if explicit:
        return explicit == "1"
    profile = os.environ.get("BATCHRL_PROFILE")
    return bool(profile) and dpo_self_play(load_profile(profile)["ops"])


def _profile_jobs() -> list:
    """With ``BATCHRL_PROFILE`` set, a job ``<profile>_profile`` runs every asset with the profile's run
    config, so the UI launches it in one click (the launchpad shows the config, editable)."""
    from batchrl.resources.profiles import load_profile

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
    from batchrl.resources.profiles import apply_resource_overrides, load_profile

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
                   run_config: dict | None = None, on_run=None, concurrent_steps: int = 1,
                   **execute_kwargs) -> dg.ExecuteInProcessResult:
    """Materialise ``selection`` (default: every asset, with its checks), after the whole-run config checks
    (``runconfig.check_whole_run``: an impossible combination fails before anything runs; ``execute_kwargs``:
    ``run_id``, ``tags`` of ``execute_in_process``). ``concurrent_steps`` 1: one step at a time in this
    process; N > 1: up to N independent steps at once, each in a process of its own (``execute_concurrently``).

    The per-drop data assets run first, one run per log drop that is new or changed (``assets.drops``:
    the drops are registered as partitions; a drop already ingested with the same content is not run
    again), then the rest in the run named by ``run_id``. ``on_run(run_id)`` is called before each run
    starts. Returns the first failed run's result, else the last run's (``NothingToRun`` if none ran)."""
    from batchrl.runs.run_config import check_whole_run

    graph = defs.resolve_asset_graph()
    check_whole_run(defs, run_config, selection)
    if concurrent_steps > 1:
        step_server.start()  # its imports overlap the per-drop runs (a no-op when `batchrl run` started it)
    job = selected_job(defs, selection)
    keys = set(job.asset_layer.executable_asset_keys)
    per_drop = {k for k in keys if graph.get(k).partitions_def is not None}
    rest = keys - per_drop
    run_config, result = run_config or {}, None
    if per_drop:
        drop_job = selected_job(defs, [k.to_user_string() for k in graph.get(next(iter(per_drop))).execution_set_asset_keys])
        drop_config = {"ops": {op: c for op, c in run_config.get("ops", {}).items() if op == DROP_OP}}
        for drop, content in drops_to_ingest(defs, instance).items():
            run_id = str(uuid.uuid4())
            if on_run:
                on_run(run_id)
            tags = {**execute_kwargs.get("tags", {}), DROP_CONTENT_TAG: content}
            result = drop_job.execute_in_process(instance=instance, run_config=drop_config, partition_key=drop,
                                                 raise_on_error=False, run_id=run_id, tags=tags)
            if not result.success:
                return result
    if not rest and result is None:
        return NothingToRun()
    if rest:
        if on_run:
            on_run(execute_kwargs.setdefault("run_id", str(uuid.uuid4())))
        rest_config = dict(run_config, ops={op: c for op, c in run_config.get("ops", {}).items() if op != DROP_OP}) \
            if per_drop and "ops" in run_config else run_config
        if concurrent_steps > 1:
            return execute_concurrently(rest, instance, rest_config, concurrent_steps, **execute_kwargs)
        result = (job.get_subset(asset_selection=rest) if per_drop else job).execute_in_process(
            instance=instance, run_config=rest_config, raise_on_error=False, **execute_kwargs)
    return result


def execute_concurrently(keys: set[dg.AssetKey], instance: dg.DagsterInstance, run_config: dict, steps: int,
                         run_id: str | None = None, tags: dict | None = None):
    """Materialise ``keys`` with the definitions' multiprocess executor (``step_executor``, the one runs from
    the UI and the daemon use), up to ``steps`` steps at once: e.g. the DPO branch trains beside the RL
    branch, their GPU jobs sharing the GPU through ``TrainerLauncherResource.gpu_job_slots``."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository
    from dagster._core.execution.api import execute_run  # execute_job's own path, with the caller's run id

    # the step processes rebuild the implicit asset job from this module's definitions (the environment's)
    implicit = defs.resolve_implicit_global_asset_job_def().name
    job = ReconstructableRepository.for_module(__name__, "defs").get_reconstructable_job(implicit) \
        .get_subset(asset_selection=frozenset(keys))
    run = instance.create_run_for_job(
        job_def=job.get_definition(), run_id=run_id, tags=tags, asset_selection=frozenset(keys),
        run_config={**run_config, "execution": {"config": {"max_concurrent": steps}}},
        job_code_origin=job.get_python_origin())
    return execute_run(job, run, instance, raise_on_error=False)


@dataclasses.dataclass
class NothingToRun:
    """``execute_assets`` of per-drop assets only, every log drop already ingested with its content."""

    success: bool = True
    run_id: str | None = None
    all_events: list = dataclasses.field(default_factory=list)

    def get_step_failure_events(self) -> list:
        return []


LANDING_STATE_KEY = "batchrl/landing_state/"


def landing_state_key(landing) -> str:
    """The instance's key-value entry that holds ``landing``'s file states (one per set of landing locations)."""
    locations = json.dumps([landing.preferences, landing.scored, landing.prompts])
    return LANDING_STATE_KEY + hashlib.sha256(locations.encode()).hexdigest()[:16]


def drops_to_ingest(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[str, str]:
    """The landing's log drops (drop -> content key) not yet ingested with that content; every landed
    drop is registered as a ``log_drops`` partition (in landing order), a drop gone from the landing removed.
    Each landed file's size, stamp and sha256 are kept in the instance (the sensor keeps them in its cursor),
    so only files new or changed since the last call are read: a landing of many gigabytes is not hashed
    again by every `batchrl run` (twice, before this: once to count the drops, once to run them)."""
    from batchrl.assets.automation import landing_state, register_drops

    landing = defs.resources["landing"]
    key = landing_state_key(landing)
    try:
        previous = json.loads(instance.run_storage.get_cursor_values({key}).get(key) or "{}")
    except ValueError:  # not JSON: hash everything again
        previous = {}
    state = landing_state(landing, previous)
    if state != previous:
        instance.run_storage.set_cursor_values({key: json.dumps(state, sort_keys=True)})
    drops = landing_drops(landing, state)
    register_drops(instance, list(drops))
    ingested = ingested_contents(instance)
    return {drop: content for drop, content in drops.items() if ingested.get(drop) != content}


def ingested_contents(instance: dg.DagsterInstance, page: int = 1000) -> dict[str, str | None]:
    """Drop -> the content key its latest ``raw_logs`` recorded, for every ingested drop: one pass over the
    materialisations, newest first (a query per drop took ~3 ms: a year of daily drops, ~1 s a look)."""
    latest: dict[str, str | None] = {}
    cursor = None
    while True:
        result = instance.fetch_materializations(dg.AssetKey("raw_logs"), limit=page, cursor=cursor)
        for record in result.records:
            materialization = record.asset_materialization
            if materialization.partition not in latest:
                value = materialization.metadata.get("drop_content")
                latest[materialization.partition] = getattr(value, "value", value)
        if not result.has_more:
            return latest
        cursor = result.cursor


defs = build_definitions()
