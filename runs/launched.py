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

from batchrl.common import dagster_internals
from batchrl.common.package import PACKAGE_DIR

CODE_LOCATION = "batchrl.definitions"  # workspace.yaml's module: also the location's name (no location_name given)
DEFS_ATTRIBUTE = "defs"
REPOSITORY = dagster_internals.REPOSITORY


def remote_job_origin(job_name: str):
    """The job's origin in the code location `dagster dev` loads from workspace.yaml (what the UI matches runs by)."""
    return dagster_internals.remote_job_origin(CODE_LOCATION, job_name, PACKAGE_DIR, sys.executable)


def reconstructable_job(job_name: str):
    """The code location's job as a process started from its module would load it (step processes, run launchers)."""
    return dagster_internals.module_job(CODE_LOCATION, DEFS_ATTRIBUTE, job_name)


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
    run_config = run_config or {}
    return dagster_internals.execute_in_process_in_run(
        job, keys, instance, run_config, partition_key, tags,
        create_run=lambda run_tags, plan: create_launched_run(instance, job, keys, run_config,
                                                              {**job.run_tags, **run_tags}, run_id, plan))
