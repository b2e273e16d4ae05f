"""MLflow tracking of the training assets against a real tracking server (``mlflow server`` on 127.0.0.1, SQLite
backend, a temp artifact root): one Dagster run trains DPO and a policy update on the tiny model (~2 min); each
materialisation is an MLflow run nested under the parent run named after the Dagster run id, with the job's
params, its per-step metrics at their step numbers and the published artifact's URI and data version. The same
run logs to W&B offline too, read back from W&B's own run files (its protobuf records)."""
from __future__ import annotations

import glob
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import dagster as dg
import pytest
from pipeline_helpers import latest_metadata, local_resources, recipe, run_assets

from batchrl.resources import TrackingResource

SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "prompts", "base_model",
             "dpo_pairs", "reference_logprobs", "dpo_checkpoint", "rollouts", "rewards", "advantages",
             "policy_checkpoint"]
OPS = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
       "dpo_pairs": {"config": {"max_logged_pairs": 16}},
       "dpo_checkpoint": {"config": {"epochs": 1, "micro_batch_size": 4}},  # 4 steps
       "rollouts": {"config": {"max_prompts": 4}},
       "policy_checkpoint": {"config": {"micro_batch_size": 2, "ppo_epochs": 2}}}  # 8 samples: 8 steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` of this environment on a free port; stopped (its process group) at the end."""
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runner: not used here
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to a minute on a loaded box; readiness, not a timing assertion
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited {server.returncode}: {(root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail(f"mlflow server not ready: {(root / 'server.log').read_text()[-2000:]}")
        yield url
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def tracked_run(mlflow_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    (root / "home").mkdir()
    from batchrl.resources.environments import environment_resources

    with dg.DagsterInstance.local_temp(str(root / "home")) as instance:
        with pytest.MonkeyPatch.context() as env:  # the variables for this run only
            for name, value in (("BATCHRL_MLFLOW_URI", mlflow_server), ("BATCHRL_MLFLOW_EXPERIMENT", "batchrl-test"),
                                ("BATCHRL_WANDB_DIR", str(root / "wandb"))):
                env.setenv(name, value)
            tracking = environment_resources("local")["tracking"]  # dg.EnvVar fields: the steps resolve them
            result = run_assets(local_resources(str(root / "storage"), tracking=tracking), instance, SELECTION,
                                {"ops": OPS, "resources": recipe(samples_per_prompt=2)})
        assert result.success
        yield result.run_id, {a: latest_metadata(instance, a) for a in ("dpo_checkpoint", "policy_checkpoint")}, \
            str(root / "wandb")


def _runs(url: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name("batchrl-test")
    return client, client.search_runs([experiment.experiment_id])


def test_each_training_materialisation_is_a_run_under_the_dagster_run(mlflow_server, tracked_run):
    dagster_run_id, _, _ = tracked_run
    client, runs = _runs(mlflow_server)
    parents = [r for r in runs if r.data.tags.get("batchrl.role") == "dagster_run"]
    assert [p.info.run_name for p in parents] == [dagster_run_id]  # one parent, however many training steps
    children = {r.data.tags["dagster.asset"]: r for r in runs if r.data.tags.get("batchrl.role") == "materialisation"}
    assert set(children) == {"dpo_checkpoint", "policy_checkpoint"}
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children.values())
    assert all(r.data.tags["dagster.run_id"] == dagster_run_id and r.info.status == "FINISHED"
               for r in children.values())


@pytest.mark.parametrize("asset, series, steps", [("dpo_checkpoint", "rewards/margins", 4),
                                                  ("policy_checkpoint", "pg_loss", 8)])
def test_params_step_metrics_and_the_artifact_are_read_back(mlflow_server, tracked_run, asset, series, steps):
    _, published, _ = tracked_run
    client, runs = _runs(mlflow_server)
    run = next(r for r in runs if r.data.tags.get("dagster.asset") == asset)
    meta = published[asset]
    # the artifact: its URI and data version, as the materialisation shows them
    assert run.data.tags["batchrl.artifact_uri"] == meta["uri"]
    assert run.data.tags["batchrl.data_version"] == run.data.params["data_version"] == meta["data_version"]
    assert run.info.run_name == f"{asset}@{meta['data_version']}"
    # params: the trainer's config (flattened), the seed, the inputs' data versions
    assert run.data.params["trainer.micro_batch_size"] == str(OPS[asset]["config"]["micro_batch_size"])
    assert run.data.params["seed"] == "0" and len(run.data.params["inputs.base_model" if asset == "dpo_checkpoint"
                                                                 else "inputs.reference"]) == 16
    # a per-step series at its step numbers, the last value the job's final one
    history = sorted(client.get_metric_history(run.info.run_id, series), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, steps + 1)) == list(range(1, meta["global_step"] + 1))
    assert history[-1].value == pytest.approx(meta[f"final/{series}"])
    assert "job_wall_s" in run.data.metrics and "world_size" not in run.data.metrics


def test_tracking_is_off_unless_the_environment_names_a_tracking_uri(monkeypatch):
    from batchrl.resources.environments import environment_resources

    monkeypatch.delenv("BATCHRL_MLFLOW_URI", raising=False)
    assert not environment_resources("local")["tracking"].enabled
    monkeypatch.delenv("BATCHRL_WANDB_DIR", raising=False)
    assert not environment_resources("local")["tracking"].enabled
    assert TrackingResource().log_training(None, asset="a", params={}, series={}, summary={}, uri="u",
                                           data_version="d") == {}  # nothing touched, not even the context
    monkeypatch.setenv("BATCHRL_MLFLOW_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("BATCHRL_MLFLOW_EXPERIMENT", "team")
    monkeypatch.setenv("BATCHRL_WANDB_DIR", "/tmp/wandb-runs")
    for env in ("local", "s3", "gpu"):
        declared = environment_resources(env)["tracking"]
        # dg.EnvVar fields: Dagster resolves them when it builds the resource (the UI shows the variables' names)
        assert declared.enabled and isinstance(declared.mlflow_uri, dg.EnvVar)
        tracking = declared.process_config_and_initialize()
        assert (tracking.mlflow_uri, tracking.experiment) == ("http://127.0.0.1:5000", "team")
        assert tracking.wandb_dir == "/tmp/wandb-runs"


def test_long_series_and_many_params_go_in_batches_to_a_local_store(tmp_path):
    """More points and params than one MLflow request takes (1,000 metrics, 100 params), to a sqlite store."""
    import logging
    import types

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    context = types.SimpleNamespace(run=types.SimpleNamespace(run_id="dagster-run"), log=logging.getLogger("test"))
    steps = list(range(1, 1501))
    params = {"trainer": {f"p{i}": i for i in range(150)}}
    run_id = TrackingResource(mlflow_uri=uri).log_training(
        context, asset="dpo_checkpoint", params=params, series={"loss": (steps, [1.0 / s for s in steps])},
        summary={"wall_s": 2.5, "stopped_early": False, "content_hash": "x"}, uri="/a", data_version="abc")["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == steps
    run = client.get_run(run_id)
    assert len(run.data.params) == 151 and run.data.params["trainer.p149"] == "149"
    assert run.data.metrics == {"loss": pytest.approx(1 / 1500), "wall_s": 2.5}  # no bool, no text


def _wandb_records(path: str):
    """The protobuf records of a W&B run file: W&B's header (':W&B', 0xBEE1, version 0), then LevelDB's log format
    (32 KiB blocks of chunks with a 7-byte header: crc, length, type full/first/middle/last). wandb 0.31 reads them
    in its Go core only, so this is the reader; the records are parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    block, pos, record = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        record = chunk if kind in (1, 2) else record + chunk
        if kind in (1, 4):  # full, or the last chunk of one
            yield wandb_internal_pb2.Record.FromString(record)


def _wandb_run(path: str) -> dict:
    """A W&B offline run as its file holds it: the run's name/group/job type/config, its history by step, summary."""
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
    run = {"history": {}, "summary": {}, "config": {}}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(name=record.run.display_name, group=record.run.run_group, job_type=record.run.job_type)
        if kind in ("run", "config"):
            config = record.run.config if kind == "run" else record.config
            run["config"].update({key(i): json.loads(i.value_json) for i in config.update})
        elif kind == "history":
            run["history"][record.history.step.num] = {key(i): json.loads(i.value_json) for i in record.history.item}
        elif kind == "summary":
            run["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def test_the_same_run_is_logged_to_wandb_offline(tracked_run):
    """W&B in offline mode (nothing sent anywhere) holds what MLflow holds: params as config, the series at their
    step numbers, the summary numbers, the artifact's URI and data version, the Dagster run id as the group."""
    dagster_run_id, published, wandb_dir = tracked_run
    runs = [_wandb_run(f) for f in glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))]
    assert sorted(r["job_type"] for r in runs) == ["dpo_checkpoint", "policy_checkpoint"]
    for run in runs:
        asset = run["job_type"]
        meta, series, steps = published[asset], *{"dpo_checkpoint": ("rewards/margins", 4),
                                                   "policy_checkpoint": ("pg_loss", 8)}[asset]
        assert run["exit_code"] == 0 and run["group"] == dagster_run_id
        assert run["name"] == f"{asset}@{meta['data_version']}"
        config = run["config"]
        assert config["batchrl.artifact_uri"] == meta["uri"]
        assert config["batchrl.data_version"] == config["data_version"] == meta["data_version"]
        assert config["trainer.micro_batch_size"] == OPS[asset]["config"]["micro_batch_size"] and config["seed"] == 0
        history = {step: row[series] for step, row in run["history"].items() if series in row}
        assert sorted(history) == list(range(1, steps + 1))
        assert history[steps] == pytest.approx(meta[f"final/{series}"])
        assert "job_wall_s" in run["summary"] and "world_size" not in run["summary"]
