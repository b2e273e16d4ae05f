"""A run's output in its own log file: a run launched from the UI or by the daemon under `dagster dev` wrote every
step's chatter (DEBUG events, transformers and DeepSpeed warnings, a trainer job's JSON line per step) into the
`dagster dev` console, as many as 826 lines for one retrain. The executor below sends its run worker's output, and
so its step processes' and their jobs' (they inherit the file descriptors), to ``<DAGSTER_HOME>/logs/run-<run id>.log``
for as long as the steps run; the UI's event log and each step's captured stdout/stderr stay as they were."""
from __future__ import annotations

import os

import dagster as dg

from batchrl.common.log_file import OUTPUT_ROUTED_ENV, output_to_log


def run_log_path(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """Where a run's output goes: under the instance's home (None for an in-memory instance, which has none)."""
    if not instance.is_persistent:
        return None
    return os.path.join(instance.root_directory, "logs", f"run-{run_id}.log")


class RunLogExecutor(dg.Executor):
    """``inner``, with its steps' output sent to the run's log file (unless the command routes it itself)."""

    def __init__(self, inner: dg.Executor):
        self.inner = inner

    @property
    def retries(self):
        return self.inner.retries

    @property
    def step_dependency_config(self):
        return self.inner.step_dependency_config

    def execute(self, plan_context, execution_plan):
        path = None if os.environ.get(OUTPUT_ROUTED_ENV) else run_log_path(plan_context.instance, plan_context.run_id)
        if path is None:
            yield from self.inner.execute(plan_context, execution_plan)
            return
        plan_context.log.info(f"steps' library output (transformers, DeepSpeed, trainer jobs): {path}")
        with output_to_log(path):
            yield from self.inner.execute(plan_context, execution_plan)


def with_run_log(executor_def: dg.ExecutorDefinition) -> dg.ExecutorDefinition:
    """``executor_def`` whose executor writes its steps' output to the run's log file (``RunLogExecutor``)."""
    create = executor_def.executor_creation_fn
    return dg.ExecutorDefinition(name=executor_def.name, config_schema=executor_def.config_schema,
                                 requirements=executor_def.get_requirements, description=executor_def.description,
                                 executor_creation_fn=lambda init_context: RunLogExecutor(create(init_context)))
