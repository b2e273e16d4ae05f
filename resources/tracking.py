"""Experiment tracking in MLflow and/or W&B (offline), beside Dagster's own record: off unless ``mlflow_uri`` or
``wandb_dir`` is set (the environments read ``BATCHRL_MLFLOW_URI`` and ``BATCHRL_WANDB_DIR``; a profile may set
``resources: {tracking: {mlflow_uri: ..., wandb_dir: ...}}``).

Each materialisation of a training asset is one MLflow run holding the job's parameters, its per-step metrics
(with their step numbers), its summary numbers and the published artifact (``batchrl.artifact_uri`` and
``batchrl.data_version`` tags, the data version also a param); it is nested under a parent run named after the
Dagster run id, so one Dagster run (a DPO and a policy update, say) is one row to expand in MLflow's UI.
``mlflow`` is imported only when tracking is on.

W&B runs offline only (``mode="offline"``: nothing leaves the machine; ``wandb sync <wandb_dir>/wandb`` uploads
later, from wherever a team's W&B is reachable): the same params as config, the same series at the same steps,
the artifact's URI and data version, the Dagster run id as the run's group (W&B's way of nesting runs).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from typing import Any, Iterator

import dagster as dg
from pydantic import Field

DAGSTER_RUN_TAG = "dagster.run_id"
ROLE_TAG = "batchrl.role"  # "dagster_run": the parent; "materialisation": a training asset's run
MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values
METRICS_PER_REQUEST, PARAMS_PER_REQUEST = 1000, 100  # MLflow's limits on one log_batch request


class TrackingResource(dg.ConfigurableResource):
    mlflow_uri: str = Field("", description="MLflow tracking URI (http://host:5000, or sqlite:///path/mlflow.db for "
                            "a local store); empty: no tracking")
    experiment: str = Field("batchrl", description="the MLflow experiment (created when missing) and the W&B "
                            "project the runs go to")
    wandb_dir: str = Field("", description="a local folder for W&B offline runs (<dir>/wandb/offline-run-*); "
                           "empty: no W&B")

    @property
    def enabled(self) -> bool:
        return bool(self.mlflow_uri or self.wandb_dir)

    def log_training(self, context: dg.AssetExecutionContext, *, asset: str, params: dict[str, Any],
                     series: dict[str, tuple[list[int], list[float]]], summary: dict[str, Any],
                     uri: str, data_version: str) -> dict[str, str]:
        """This materialisation of ``asset`` logged to each tracker that is on: ``{"mlflow": run id, "wandb": run
        id}`` (empty with tracking off). ``series``: ``{metric: (steps, values)}``; ``summary``: numbers of the run
        as a whole, logged at its last step."""
        logged = {}
        if self.mlflow_uri:
            logged["mlflow"] = self._log_mlflow(context, asset, params, series, summary, uri, data_version)
        if self.wandb_dir:
            logged["wandb"] = self._log_wandb(context, asset, params, series, summary, uri, data_version)
        return logged

    def _log_mlflow(self, context, asset, params, series, summary, uri, data_version) -> str:
        """One MLflow run for this materialisation under the Dagster run's parent run."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        client = MlflowClient(tracking_uri=self.mlflow_uri)
        experiment_id = self._experiment_id(client)
        parent = self._parent_run(client, experiment_id, context.run.run_id)
        run = client.create_run(experiment_id, run_name=f"{asset}@{data_version}", tags={
            "mlflow.parentRunId": parent, DAGSTER_RUN_TAG: context.run.run_id, ROLE_TAG: "materialisation",
            "dagster.asset": asset, "batchrl.artifact_uri": uri, "batchrl.data_version": data_version})
        now = int(time.time() * 1000)
        last_step = max((steps[-1] for steps, _ in series.values() if steps), default=0)
        metrics = [Metric(name, value, now, step) for name, (steps, values) in series.items()
                   for step, value in zip(steps, values)]
        metrics += [Metric(name, float(value), now, last_step) for name, value in _numbers(summary, series).items()]
        param_list = [Param(key, str(value)[:MAX_PARAM_CHARS]) for key, value in
                      sorted(_params(params, data_version).items())]
        for start in range(0, len(metrics), METRICS_PER_REQUEST):
            client.log_batch(run.info.run_id, metrics=metrics[start:start + METRICS_PER_REQUEST])
        for start in range(0, len(param_list), PARAMS_PER_REQUEST):
            client.log_batch(run.info.run_id, params=param_list[start:start + PARAMS_PER_REQUEST])
        client.set_terminated(run.info.run_id)
        client.set_terminated(parent)  # finished as of its latest training asset; a later one still nests
        context.log.info(f"MLflow: run {run.info.run_id} ({asset}) under {parent} at {self.mlflow_uri}")
        return run.info.run_id

    def _log_wandb(self, context, asset, params, series, summary, uri, data_version) -> str:
        """One W&B offline run for this materialisation, grouped under the Dagster run id."""
        # W&B's core service exports its own error reports and telemetry unless told not to: offline means offline
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        settings = wandb.Settings(mode="offline", silent=True, console="off", save_code=False, disable_git=True,
                                  x_disable_stats=True, x_save_requirements=False)  # the lineage records those
        config = {**_params(params, data_version), "batchrl.artifact_uri": uri, "batchrl.data_version": data_version,
                  "dagster.run_id": context.run.run_id, "dagster.asset": asset}
        os.makedirs(self.wandb_dir, exist_ok=True)  # W&B writes to a temp dir, with a warning, when it is missing
        run = wandb.init(dir=self.wandb_dir, project=self.experiment, name=f"{asset}@{data_version}",
                         group=context.run.run_id, job_type=asset, config=config, settings=settings,
                         reinit="create_new")  # one run per materialisation, even with another open in the process
        try:
            by_step: dict[int, dict[str, float]] = {}
            for name, (steps, values) in series.items():
                for step, value in zip(steps, values):
                    by_step.setdefault(step, {})[name] = value
            for step in sorted(by_step):  # W&B takes one row per step, steps in increasing order
                run.log(by_step[step], step=step)
            run.summary.update(_numbers(summary, series))
        finally:
            run.finish()
        context.log.info(f"W&B: offline run {run.id} ({asset}) in {self.wandb_dir}")
        return run.id

    def _experiment_id(self, client) -> str:
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        from mlflow.exceptions import MlflowException

        try:
            return client.create_experiment(self.experiment)
        except MlflowException:  # created meanwhile by a step beside this one
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _parent_run(self, client, experiment_id: str, dagster_run_id: str) -> str:
        """The run named after ``dagster_run_id``, created by the first training step of that Dagster run (steps
        side by side take a lock on this host, so they find one parent, not one each)."""
        with _host_lock(f"{self.mlflow_uri}|{experiment_id}|{dagster_run_id}"):
            existing = client.search_runs(
                [experiment_id], max_results=1,
                filter_string=f"tags.`{DAGSTER_RUN_TAG}` = '{dagster_run_id}' and tags.`{ROLE_TAG}` = 'dagster_run'")
            if existing:
                return existing[0].info.run_id
            return client.create_run(experiment_id, run_name=dagster_run_id, tags={
                DAGSTER_RUN_TAG: dagster_run_id, ROLE_TAG: "dagster_run"}).info.run_id


@contextlib.contextmanager
def _host_lock(key: str) -> Iterator[None]:
    path = os.path.join(tempfile.gettempdir(), f"batchrl-mlflow-{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock")
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _params(params: dict[str, Any], data_version: str) -> dict[str, Any]:
    return {**flatten(params), "data_version": data_version}


def _numbers(summary: dict[str, Any], series: dict) -> dict[str, float]:
    """The summary's numbers (no bool, no text) that are not a series' own points already."""
    return {name: float(value) for name, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in series}


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as MLflow params: ``{"trainer": {"lr": 1e-3}}`` -> ``{"trainer.lr": 1e-3}``."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
