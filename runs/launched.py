"""A run of the code location's asset job executed in this process, recorded in the instance as the webserver
records the runs it launches: the job's snapshot (and its parent's, for a subset) from the code location's own job,
and the origins of that code location (``workspace.yaml``'s python_module ``batchrl.definitions``).

``JobDefinition.execute_in_process`` records neither: its run has the snapshot of an ephemeral job (the in-process
executor swapped in) and no remote origin, so the UI showed such runs without a target, left them off the Overview
timeline (it groups runs by their repository, the ``.dagster/repository`` tag that the origin gives) and warned on
Re-execute that the job "may be a different version" (the run's snapshot matched no loaded job)."""
from __future__ import annotations

import sys

import dagster as dg

from batchrl.common.package import PACKAGE_DIR

CODE_LOCATION = "batchrl.definitions"  # workspace.yaml's module: also the location's name (no location_name given)
DEFS_ATTRIBUTE = "defs"
REPOSITORY = "__repository__"  # Dagster's name for the repository of a Definitions object


def remote_job_origin(job_name: str):
    """The job's origin in the code location `dagster dev` loads from workspace.yaml (what the UI matches runs by)."""
    from dagster._core.remote_origin import ManagedGrpcPythonEnvCodeLocationOrigin, RemoteRepositoryOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    target = LoadableTargetOrigin(executable_path=sys.executable, module_name=CODE_LOCATION,
                                  working_directory=PACKAGE_DIR)
    location = ManagedGrpcPythonEnvCodeLocationOrigin(target, location_name=CODE_LOCATION)
    return RemoteRepositoryOrigin(code_location_origin=location, repository_name=REPOSITORY).get_job_origin(job_name)


def reconstructable_job(job_name: str):
    """The code location's job as a process started from its module would load it (step processes, run launchers)."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository

    return ReconstructableRepository.for_module(CODE_LOCATION, DEFS_ATTRIBUTE).get_reconstructable_job(job_name)


def create_launched_run(instance: dg.DagsterInstance, job: dg.JobDefinition, keys: set[dg.AssetKey],
                        run_config: dict, tags: dict, run_id: str | None = None, execution_plan=None):
    """A run of ``job`` cut to ``keys``, created with the code location's origins (``execution_plan``: the one that
    will run, default the job's own)."""
    return instance.create_run_for_job(
        job_def=job, execution_plan=execution_plan, run_id=run_id, run_config=run_config, tags=tags,
        asset_selection=frozenset(keys), remote_job_origin=remote_job_origin(job.name),
        job_code_origin=reconstructable_job(job.name).get_python_origin())


def execute_launched_in_process(job: dg.JobDefinition, keys: set[dg.AssetKey], instance: dg.DagsterInstance,
                                run_config: dict | None = None, partition_key: str | None = None,
                                run_id: str | None = None, tags: dict | None = None) -> dg.ExecuteInProcessResult:
    """``job`` (the code location's asset job, whole) cut to ``keys`` and executed step after step in this process,
    as ``execute_in_process`` does, in a run recorded as launched from the code location."""
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import ExecuteRunWithPlanIterable, create_execution_plan, job_execution_iterator
    from dagster._core.execution.context_creation_job import (
        PlanOrchestrationContextManager, orchestration_context_event_generator,
    )
    from dagster._core.execution.execute_in_process import merge_run_tags

    run_config = run_config or {}
    in_process = InMemoryJob(job.as_ephemeral_job(resource_defs={}, input_values={}, asset_selection=list(keys)))
    subset = job.get_subset(asset_selection=frozenset(keys))
    tags = merge_run_tags(job_def=subset, partition_key=partition_key, tags=tags, asset_selection=list(keys),
                          instance=instance, run_config=run_config)
    plan = create_execution_plan(in_process, run_config=run_config, instance_ref=instance.get_ref()
                                 if instance.is_persistent else None, tags=tags)
    run = create_launched_run(instance, job, keys, run_config, {**job.run_tags, **tags}, run_id, plan)
    output_capture: dict = {}
    events = list(ExecuteRunWithPlanIterable(
        execution_plan=plan, iterator=job_execution_iterator,
        execution_context_manager=PlanOrchestrationContextManager(
            context_event_generator=orchestration_context_event_generator, job=in_process, execution_plan=plan,
            dagster_run=run, instance=instance, run_config=run_config, executor_defs=None,
            output_capture=output_capture, raise_on_error=False)))
    return dg.ExecuteInProcessResult(job_def=in_process.get_definition(), event_list=events,
                                     dagster_run=instance.get_run_by_id(run.run_id), output_capture=output_capture)
