"""Executing a selection of the code location's assets: the per-drop assets first, one run per log drop to
ingest, then the rest, one step at a time in this process or up to N at once in forked step processes."""
from __future__ import annotations

import dataclasses
import uuid

import dagster as dg

from batchrl.assets.data import DROP_CONTENT_TAG
from batchrl.assets.drops import DROP_OP
from batchrl.common import dagster_internals
from batchrl.runs import step_server
from batchrl.runs.launched import create_launched_run, execute_launched_in_process, reconstructable_job
from batchrl.runs.log_drops import drops_to_ingest
from batchrl.runs.run_config import check_whole_run


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
    (``run_config.check_whole_run``: an impossible combination fails before anything runs; ``execute_kwargs``:
    ``run_id``, ``tags`` of the run). ``concurrent_steps`` 1: one step at a time in this
    process; N > 1: up to N independent steps at once, each in a process of its own (``execute_concurrently``).

    The per-drop data assets run first, one run per log drop that is new or changed (``assets.drops``:
    the drops are registered as partitions; a drop already ingested with the same content is not run
    again), then the rest in the run named by ``run_id``. ``on_run(run_id)`` is called before each run
    starts. Every run is recorded as launched from the code location (``runs.launched``): the UI shows its target
    and re-executes it. Returns the first failed run's result, else the last run's (``NothingToRun`` if none ran)."""
    graph = defs.resolve_asset_graph()
    check_whole_run(defs, run_config, selection)
    if concurrent_steps > 1:
        step_server.start()  # its imports overlap the per-drop runs (a no-op when `batchrl run` started it)
    job, whole = selected_job(defs, selection), defs.resolve_implicit_global_asset_job_def()
    keys = set(job.asset_layer.executable_asset_keys)
    per_drop = {k for k in keys if graph.get(k).partitions_def is not None}
    rest = keys - per_drop
    run_config, result = run_config or {}, None
    if per_drop:
        drop_keys = set(graph.get(next(iter(per_drop))).execution_set_asset_keys)
        drop_config = {"ops": {op: c for op, c in run_config.get("ops", {}).items() if op == DROP_OP}}
        for drop, content in drops_to_ingest(defs, instance).items():
            run_id = str(uuid.uuid4())
            if on_run:
                on_run(run_id)
            tags = {**execute_kwargs.get("tags", {}), DROP_CONTENT_TAG: content}
            result = execute_launched_in_process(whole, drop_keys, instance, drop_config, partition_key=drop,
                                                 run_id=run_id, tags=tags)
            if not result.success:
                return result
    if not rest and result is None:
        return NothingToRun()
    if rest:
        if on_run:
            on_run(execute_kwargs.setdefault("run_id", str(uuid.uuid4())))
        rest_config = dict(run_config, ops={op: c for op, c in run_config.get("ops", {}).items() if op != DROP_OP}) \
            if per_drop and "ops" in run_config else run_config
        if concurrent_steps > 1 and not is_chain(job.get_subset(asset_selection=rest) if per_drop else job):
            return execute_concurrently(defs, rest, instance, rest_config, concurrent_steps, **execute_kwargs)
        result = execute_launched_in_process(whole, rest, instance, rest_config, **execute_kwargs)
    return result


def is_chain(job: dg.JobDefinition) -> bool:
    """Every step of ``job`` waits for the one before (e.g. an RL iteration: rollouts → rewards → advantages →
    policy_checkpoint): no two could ever run at once, so a multiprocess run would only add a step process per
    step (fork, job rebuilt, resources and instance opened again: ~0.2 s a step on the H200's host, ~0.45 s on
    the dev box, against ~0.01 s between steps in process)."""
    return all(len(level) == 1 for level in dagster_internals.steps_by_level(job))


def execute_concurrently(defs: dg.Definitions, keys: set[dg.AssetKey], instance: dg.DagsterInstance,
                         run_config: dict, steps: int, run_id: str | None = None, tags: dict | None = None):
    """Materialise ``keys`` with the definitions' multiprocess executor (``step_executor``, the one runs from
    the UI and the daemon use), up to ``steps`` steps at once: e.g. the DPO branch trains beside the RL
    branch, their GPU jobs sharing the GPU through ``TrainerLauncherResource.gpu_job_slots``."""
    # the step processes rebuild the implicit asset job (its name is the same in ``defs``) from the code
    # location's definitions (the environment's)
    whole = reconstructable_job(defs.resolve_implicit_global_asset_job_def().name)
    run = create_launched_run(instance, whole.get_definition(), keys, tags=tags or {}, run_id=run_id,
                              run_config={**run_config, "execution": {"config": {"max_concurrent": steps}}})
    # execute_job's own path, in the run created above (the caller's run id, the code location's origins)
    return dagster_internals.execute_created_run(whole.get_subset(asset_selection=frozenset(keys)), run, instance)


@dataclasses.dataclass
class NothingToRun:
    """``execute_assets`` of per-drop assets only, every log drop already ingested with its content."""

    success: bool = True
    run_id: str | None = None
    all_events: list = dataclasses.field(default_factory=list)

    def get_step_failure_events(self) -> list:
        return []
