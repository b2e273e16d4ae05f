"""Data-stage behaviour through Dagster: the blocking gate per drop, a drop that changed, S3 storage, CLI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import dagster as dg
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.definitions import build_definitions

from batchrl.assets.automation import new_logs_sensor
from batchrl.resources import LandingResource, StorageResource

DATA = ["raw_logs", "cleaned_logs", "validated_preferences"]
SAMPLES = LandingResource()


def _landing_copy(tmp_path) -> LandingResource:
    prefs = tmp_path / "landing" / "preferences"
    shutil.copytree(SAMPLES.preferences, prefs)
    return LandingResource(preferences=str(prefs))


def test_blocking_reject_rate_check_stops_training(tmp_path):
    landing = _landing_copy(tmp_path)
    with open(os.path.join(landing.preferences, "zz_broken.jsonl"), "w") as f:
        for i in range(60):  # far above the 5% default threshold
            f.write(json.dumps({"prompt": f"q{i}", "chosen": "", "rejected": "x"}) + "\n")
    with dg.DagsterInstance.ephemeral() as instance:
        result = run_assets(local_resources(str(tmp_path / "s"), landing), instance,
                            selection=DATA + ["prompts", "base_model"])
        checks = {e.event_specific_data.check_name: e.event_specific_data.passed
                  for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
        assert checks == {"nothing_lost": True, "reject_rate_below_threshold": False}
        assert instance.get_latest_materialization_event(dg.AssetKey("base_model")) is None
        assert latest_metadata(instance, "validated_preferences")["reject_rate"] > 0.05
        # the gate applies per drop: the training window leaves the bad drop out and names it
        assert run_assets(local_resources(str(tmp_path / "s"), landing), instance, ["preference_window"]).success
        window = latest_metadata(instance, "preference_window")
        assert window["drops"] == ["prefs_000.jsonl", "prefs_001.jsonl"]
        assert window["drops_failing_gate"] == ["zz_broken.jsonl"] and window["rows"] == 246


def test_window_of_the_last_drops_and_each_drop_ingested_once(tmp_path):
    """~4 s. ``last_drops: 1`` reads the newest drop only (the older one named); a drop is ingested in a run
    of its own, once. (What asks for the retrain: tests/test_automation.py.)"""
    landing = _landing_copy(tmp_path)
    resources = local_resources(str(tmp_path / "s"), landing)
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        assert run_assets(resources, instance, DATA).success
        last = {"ops": {"preference_window": {"config": {"last_drops": 1}}}}
        assert run_assets(resources, instance, ["preference_window"], last).success
        window = latest_metadata(instance, "preference_window")
        assert window["drops"] == ["prefs_001.jsonl"] and window["drops_outside_window"] == ["prefs_000.jsonl"]
        with open(os.path.join(landing.preferences, "prefs_002.jsonl"), "w") as f:
            f.write(json.dumps({"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}) + "\n")
        assert run_assets(resources, instance, DATA).success
        assert instance.get_materialized_partitions(dg.AssetKey("validated_preferences")) == {
            "prefs_000.jsonl", "prefs_001.jsonl", "prefs_002.jsonl"}
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "prefs_000.jsonl"}))
        assert len(runs) == 1  # ingested once, in its own run
        count = len(instance.get_runs())
        assert run_assets(resources, instance, DATA).success and len(instance.get_runs()) == count  # none new


def test_drop_changed_after_the_sensor_saw_it_fails_loudly(tmp_path):
    landing = _landing_copy(tmp_path)
    cursor = new_logs_sensor(dg.build_sensor_context(resources={"landing": landing})).cursor
    with open(os.path.join(landing.preferences, "prefs_000.jsonl"), "a") as f:  # sent again: ingested again
        f.write(json.dumps({"prompt": "again", "chosen": "a", "rejected": "b"}) + "\n")
    result = new_logs_sensor(dg.build_sensor_context(cursor=cursor, resources={"landing": landing}))
    (request,) = result.run_requests
    with open(os.path.join(landing.preferences, request.partition_key), "a") as f:  # and changed before its run
        f.write(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    with dg.DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("log_drops", [request.partition_key])
        job = build_definitions(local_resources(str(tmp_path / "s"), landing)).resolve_job_def("retrain")
        run = job.get_subset(asset_selection=set(request.asset_selection)).execute_in_process(
            instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False)
        assert not run.success
        errors = [e.event_specific_data.error.to_string() for e in run.get_step_failure_events()]
        assert any("changed since the sensor saw it" in text and request.partition_key in text for text in errors)


def test_data_assets_on_s3_storage_and_landing(s3_server, tmp_path):
    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_server}}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("landing-bucket")
    fs.put(SAMPLES.preferences, "landing-bucket/drop1/preferences", recursive=True)
    landing = LandingResource(preferences="s3://landing-bucket/drop1/preferences", storage_options=options)
    fs.mkdir("artifacts-bucket")
    storage = StorageResource(root="s3://artifacts-bucket/batchrl", storage_options=options,
                              cache_dir=str(tmp_path / "cache"))
    with dg.DagsterInstance.ephemeral() as instance:
        result = run_assets(local_resources(str(tmp_path), landing, storage=storage), instance, selection=DATA)
        assert result.success
        s3_meta = latest_metadata(instance, "validated_preferences")
    assert s3_meta["uri"].startswith("s3://artifacts-bucket/batchrl/validated_preferences/")
    assert fs.exists(s3_meta["uri"] + "/preferences.parquet") and fs.exists(s3_meta["uri"] + "/lineage.json")
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_assets(local_resources(str(tmp_path / "local")), instance, selection=DATA).success
        local_meta = latest_metadata(instance, "validated_preferences")
    assert (s3_meta["valid"], s3_meta["quarantined"]) == (local_meta["valid"], local_meta["quarantined"])


def test_batchrl_run_drops_then_dagster_cli_window_then_audit(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "BATCHRL_STORAGE": str(tmp_path / "storage")}
    os.makedirs(env["DAGSTER_HOME"])
    bindir = os.path.dirname(sys.executable)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # `batchrl run` registers the landed drops as partitions and ingests each; the dagster CLI then
    # materialises the unpartitioned window over them
    subprocess.run([os.path.join(bindir, "batchrl"), "run", "--select", ",".join(DATA)], cwd=repo, env=env,
                   check=True, capture_output=True)
    subprocess.run([os.path.join(bindir, "dagster"), "asset", "materialize", "-m", "batchrl.definitions",
                    "--select", "preference_window"], cwd=repo, env=env, check=True, capture_output=True)
    audit = subprocess.run([os.path.join(bindir, "batchrl"), "audit", "preference_window"], cwd=repo, env=env,
                           check=True, capture_output=True, text=True).stdout
    assert "validated_preferences@" in audit and "raw_logs@" in audit
    sample = sorted(f for f in os.listdir(SAMPLES.preferences) if f.endswith(".jsonl"))[0]
    assert sample in audit and "[ok]" in audit


def test_environment_picks_resources_by_config(monkeypatch, tmp_path):
    from batchrl.resources.environments import RESOURCES_BY_ENV

    monkeypatch.setenv("BATCHRL_STORAGE", str(tmp_path))
    monkeypatch.setenv("BATCHRL_S3_ROOT", "s3://team-bucket/batchrl")
    monkeypatch.setenv("BATCHRL_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("BATCHRL_LANDING", "s3://team-bucket/landing")
    monkeypatch.setenv("BATCHRL_NUM_GPUS", "2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    local, s3, gpu = (RESOURCES_BY_ENV[env]() for env in ("local", "s3", "gpu"))
    # compiled kernels are cached beside the storage for the next retrain; a variable already set wins; the
    # jobs tokenise on every core (the console switches that off for its own process)
    assert gpu["trainer"].env == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "_cache" / "torch" / "inductor"),
                                  "TRITON_CACHE_DIR": "/elsewhere/triton", "TOKENIZERS_PARALLELISM": "true"}
    assert local["storage"].root == str(tmp_path) and local["storage"].is_local()
    assert s3["storage"].root == "s3://team-bucket/batchrl" and not s3["storage"].is_local()
    assert s3["landing"].preferences == "s3://team-bucket/landing/preferences"
    assert s3["landing"].storage_options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    monkeypatch.setenv("BATCHRL_ROLLOUT_ENGINE", "vllm")  # chosen: kept asleep in the job worker between steps
    chosen = RESOURCES_BY_ENV["gpu"]()["rollout_engine"]
    assert (chosen.kind, chosen.vllm_resident, gpu["trainer"].num_gpus) == ("vllm", True, 2)
    # by default the GPU environment rolls out with the static-cache engine on CUDA (measured faster than vLLM
    # at the GSM8K profile's size, installed or not), in a Pipes subprocess; locally sampling stays in the Dagster
    # process
    assert not gpu["rollout_engine"].vllm_resident
    assert (gpu["rollout_engine"].kind, gpu["rollout_engine"].device) == ("static", "cuda")
    assert gpu["rollout_engine"].in_subprocess and not local["rollout_engine"].in_subprocess
    assert gpu["compute"].in_subprocess and gpu["compute"].generation_engine == "static"
    assert not local["compute"].in_subprocess and local["compute"].generation_engine == "transformers"
    assert (gpu["compute"].device, local["compute"].device) == ("cuda", "cpu")
    assert (local["rollout_engine"].kind, local["trainer"].num_gpus) == ("transformers", 0)
    assert (gpu["trainer"].gpu_job_slots, local["trainer"].gpu_job_slots) == (2, 1)
    assert local["landing"].preferences == "s3://team-bucket/landing/preferences"  # BATCHRL_LANDING in every env
    monkeypatch.setenv("BATCHRL_LANDING", str(tmp_path / "logs") + "/")
    assert RESOURCES_BY_ENV["local"]()["landing"].eval_prompts == str(tmp_path / "logs" / "arith" / "eval.jsonl")
    monkeypatch.delenv("BATCHRL_LANDING")
    assert RESOURCES_BY_ENV["local"]()["landing"] == LandingResource()  # the shipped samples


def test_validated_drop_published_with_the_hash_its_writers_took(tmp_path, monkeypatch):
    """The drop's Parquet files are hashed while written, not read again to publish; the data version is
    the same tree hash the files give when read."""
    from batchrl.common import fsutil

    hashed_trees = []
    real_tree = fsutil.sha256_tree
    monkeypatch.setattr(fsutil, "sha256_tree", lambda fs, root: hashed_trees.append(root) or real_tree(fs, root))
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_assets(local_resources(str(tmp_path / "s"), _landing_copy(tmp_path)), instance, DATA).success
        published = sorted((tmp_path / "s" / "validated_preferences").iterdir())
        assert len(published) == 2  # one per drop
        for folder in published:
            data_files = {p.name: fsutil.sha256_file(fsutil.filesystem_for(str(p))[0], str(p))
                          for p in folder.iterdir() if p.name.endswith(".parquet")}
            assert set(data_files) == {"preferences.parquet", "quarantine.parquet"}
            assert fsutil.tree_hash(data_files)[:16] == folder.name
    assert not any("validated_preferences" in root for root in hashed_trees)  # publish took the writers' hash
    assert hashed_trees  # the JSON artifacts (manifest, report) are still hashed at publish


def test_a_scored_drop_is_refused_before_anything_is_published(tmp_path):
    """``kind: scored`` on log_drop once published scored rows as validated_preferences (checks passing) and the
    window then failed with a bare FileNotFoundError: now both the CLI's up-front check and the step itself
    refuse it, naming the reason, and no data asset is materialised."""
    bad = tmp_path / "run.yaml"
    bad.write_text("ops:\n  log_drop:\n    config:\n      kind: scored\n")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "BATCHRL_STORAGE": str(tmp_path / "storage")}
    out = subprocess.run([sys.executable, "-m", "batchrl.cli", "run", "-c", str(bad)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "kind 'scored'" in out.stderr and "scored_logs" in out.stderr, out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "storage")
    with dg.DagsterInstance.ephemeral() as instance:  # a run launched from the UI skips the CLI's check
        result = run_assets(local_resources(str(tmp_path / "s"), _landing_copy(tmp_path)), instance,
                            selection=DATA, run_config={"ops": {"log_drop": {"config": {"kind": "scored"}}}})
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "kind 'scored'" in str(failure.event_specific_data.error)
        assert instance.get_latest_materialization_event(dg.AssetKey("validated_preferences")) is None
