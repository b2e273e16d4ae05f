"""Every use batchrl makes of Dagster below its public API (``dagster._…``), in this one module: what Dagster 1.13
offers no public way to do. Each function says why; ``tests/test_dagster_internals.py`` checks that every name
imported here exists in the installed Dagster and that each function still does what its callers rely on, so a
Dagster bump is one run of that test. Nothing else in the package imports ``dagster._`` (tests/test_import_graph.py).

Dagster is imported inside the functions: the step server and the CLI import this module before they load Dagster."""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import dagster as dg

REPOSITORY = "__repository__"  # Dagster's name for the repository of a Definitions object

# modules that a run's process and its step processes import in their first seconds, preloaded by the warm command
# server and the step server (only their import is relied on, not their contents)
RUN_MODULES = ("dagster._core.execution.api", "dagster._core.definitions.reconstruct",
               "dagster._core.executor.multiprocess")
STORAGE_MODULES = ("dagster._core.instance.factory", "dagster._core.storage.sqlite_storage")


def remote_job_origin(module: str, job_name: str, working_directory: str, executable: str):
    """The origin of ``job_name`` in the code location that ``workspace.yaml``'s ``python_module: module`` loads:
    the UI matches a run to its job and groups it on the Overview timeline by it. Dagster builds it only from a
    loaded workspace (the webserver's); no public constructor exists."""
    from dagster._core.remote_origin import ManagedGrpcPythonEnvCodeLocationOrigin, RemoteRepositoryOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    target = LoadableTargetOrigin(executable_path=executable, module_name=module, working_directory=working_directory)
    location = ManagedGrpcPythonEnvCodeLocationOrigin(target, location_name=module)
    return RemoteRepositoryOrigin(code_location_origin=location, repository_name=REPOSITORY).get_job_origin(job_name)


def module_job(module: str, attribute: str, job_name: str):
    """``job_name`` of the Definitions at ``module.attribute``, reconstructable in another process with the code
    pointer the webserver records for that module (public ``dg.reconstructable`` takes a job-returning function
    instead, and records that function's module)."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository

    return ReconstructableRepository.for_module(module, attribute).get_reconstructable_job(job_name)


def execute_in_process_in_run(job: dg.JobDefinition, keys: set[dg.AssetKey], instance: dg.DagsterInstance,
                              run_config: dict, partition_key: str | None, tags: dict | None,
                              create_run: Callable) -> dg.ExecuteInProcessResult:
    """``job`` cut to ``keys``, executed step after step in this process as ``JobDefinition.execute_in_process``
    does, in the run that ``create_run(run_tags, execution_plan)`` creates: ``execute_in_process`` creates its own
    run (an ephemeral job's snapshot, no origin) and no public API executes in process in a run made beforehand."""
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import ExecuteRunWithPlanIterable, create_execution_plan, job_execution_iterator
    from dagster._core.execution.context_creation_job import (
        PlanOrchestrationContextManager, orchestration_context_event_generator,
    )
    from dagster._core.execution.execute_in_process import merge_run_tags
    import dagster as dg

    in_process = InMemoryJob(job.as_ephemeral_job(resource_defs={}, input_values={}, asset_selection=list(keys)))
    subset = job.get_subset(asset_selection=frozenset(keys))
    tags = merge_run_tags(job_def=subset, partition_key=partition_key, tags=tags, asset_selection=list(keys),
                          instance=instance, run_config=run_config)
    plan = create_execution_plan(in_process, run_config=run_config, instance_ref=instance.get_ref()
                                 if instance.is_persistent else None, tags=tags)
    run = create_run(tags, plan)
    output_capture: dict = {}
    events = list(ExecuteRunWithPlanIterable(
        execution_plan=plan, iterator=job_execution_iterator,
        execution_context_manager=PlanOrchestrationContextManager(
            context_event_generator=orchestration_context_event_generator, job=in_process, execution_plan=plan,
            dagster_run=run, instance=instance, run_config=run_config, executor_defs=None,
            output_capture=output_capture, raise_on_error=False)))
    return dg.ExecuteInProcessResult(job_def=in_process.get_definition(), event_list=events,
                                     dagster_run=instance.get_run_by_id(run.run_id), output_capture=output_capture)


def execute_created_run(job, run: dg.DagsterRun, instance: dg.DagsterInstance):
    """Execute ``run``, created beforehand (its id, origins), with the reconstructable ``job``'s executor: public
    ``dg.execute_job`` runs the same path but creates its own run."""
    from dagster._core.execution.api import execute_run

    return execute_run(job, run, instance, raise_on_error=False)


def steps_by_level(job: dg.JobDefinition) -> list[list[str]]:
    """The step keys of ``job``'s execution plan, level by level (a level's steps could run at once): the plan is
    not public."""
    from dagster._core.execution.api import create_execution_plan

    return [[step.key for step in level] for level in create_execution_plan(job).get_steps_to_execute_by_level()]


def stale_causes(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[dg.AssetKey, list[dict]]:
    """``{key: [{"category": CODE|DATA|DEPENDENCIES, "key": cause's asset key, "reason": ...}]}`` of every asset
    Dagster judges stale, as the UI shows it: staleness is public only through the webserver's GraphQL."""
    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus

    graph = defs.resolve_asset_graph()
    now = datetime.datetime.now(datetime.timezone.utc)
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=now, last_event_id=None),
                          instance=instance, asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance=instance, asset_graph=graph, loading_context=view)
    return {key: [{"category": c.category.value, "key": c.key.asset_key, "reason": c.reason}
                  for c in resolver.get_stale_causes(key)]
            for key in graph.materializable_asset_keys if resolver.get_status(key) == StaleStatus.STALE}


def takes_any_config(op: dg.OpDefinition) -> bool:
    """Whether ``op``'s config schema is Dagster's permissive ``Any`` (what an asset without config gets): a
    schema's kind is not public."""
    from dagster._config import ConfigTypeKind

    field = op.config_field
    return field is None or field.config_type.kind == ConfigTypeKind.ANY


def share_revision_check_scripts(script_directory_class: type) -> None:
    """Make Dagster's SQL storages' alembic revision checks get their ``ScriptDirectory`` from
    ``script_directory_class.from_config`` (``runs.alembic_scripts``: one read of the scripts per process); the
    class must carry ``shared = True``. Dagster reads the scripts again for every database it opens, with no
    setting to change it."""
    import dagster._core.storage.sql as dagster_sql

    if not getattr(dagster_sql.ScriptDirectory, "shared", False):
        dagster_sql.ScriptDirectory = script_directory_class


def run_storage_alembic_config():
    """The alembic config of the SQLite run storage's migration scripts (what its revision check reads)."""
    from dagster._core.storage.runs.sqlite import sqlite_run_storage
    from dagster._core.storage.sql import get_alembic_config

    return get_alembic_config(sqlite_run_storage.__file__)


def run_storage_revision(instance: dg.DagsterInstance) -> tuple:
    """(the run database's alembic revision, the scripts' head) as Dagster's revision check reports them."""
    import sys

    from dagster._core.storage.sql import check_alembic_revision, get_alembic_config

    storage = instance.run_storage
    with storage.connect() as conn:
        return tuple(check_alembic_revision(get_alembic_config(sys.modules[type(storage).__module__].__file__), conn))


def dagster_tail_file(path: str, closed: Callable[[], bool]):
    """Dagster's own tail of a Pipes messages file: tests show the message it can lose, why
    ``resources.pipes_messages`` has its own."""
    from dagster._utils import tail_file

    return tail_file(path, closed)
