"""The new-logs sensor keys runs by landing *content*: a new or changed file retrains once, a touched but
unchanged file does not, only changed files are hashed again; each new log drop becomes a partition,
ingested once; local folders and s3:// prefixes alike."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import dagster as dg

from batchrl.assets.automation import PER_DROP, new_logs_sensor
from batchrl.assets.data import DROP_CONTENT_TAG
from batchrl.resources import LandingResource

SAMPLES = LandingResource()


def _evaluate(landing: LandingResource, cursor: str | None) -> tuple[dg.SensorResult, str]:
    result = new_logs_sensor(dg.build_sensor_context(cursor=cursor, resources={"landing": landing}))
    return result, result.cursor


def _partitions(result: dg.SensorResult) -> list[tuple[str, list[str]]]:
    return [(type(r).__name__, list(r.partition_keys)) for r in result.dynamic_partitions_requests or []]


def _write(path, rows: int, start: int = 0) -> str:
    with open(path, "w") as f:
        f.write("".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n"
                        for i in range(start, start + rows)))
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_runs_are_keyed_by_content_not_by_timestamps(tmp_path):
    shutil.copytree(SAMPLES.preferences, tmp_path / "prefs")
    landing = LandingResource(preferences=str(tmp_path / "prefs"))
    first, cursor = _evaluate(landing, None)
    ingest, retrain = first.run_requests  # each drop once: the first alone, the last with the training stages
    assert (ingest.partition_key, retrain.partition_key) == ("prefs_000.jsonl", "prefs_001.jsonl")
    assert ingest.asset_selection == PER_DROP and retrain.asset_selection is None
    assert ingest.run_key == f"prefs_000.jsonl@{ingest.tags[DROP_CONTENT_TAG]}"
    assert "prefs_000.jsonl@" in retrain.tags["batchrl/changed_files"]
    assert json.loads(cursor)["content"] == retrain.run_key
    assert _partitions(first) == [("AddDynamicPartitionsRequest", ["prefs_000.jsonl", "prefs_001.jsonl"])]

    again, cursor = _evaluate(landing, cursor)
    assert again.skip_reason and not again.run_requests
    os.utime(tmp_path / "prefs" / "prefs_000.jsonl", (1, 1))  # touched, same bytes
    touched, touched_cursor = _evaluate(landing, cursor)
    assert touched.skip_reason and not touched.run_requests
    assert json.loads(touched_cursor)["files"] != json.loads(cursor)["files"]  # new stamp remembered

    digest = _write(tmp_path / "prefs" / "drop_002.jsonl", 5)
    new, cursor = _evaluate(landing, touched_cursor)
    (request,) = new.run_requests  # only the new drop, the old ones are not ingested again
    assert request.partition_key == "drop_002.jsonl" and request.run_key not in (ingest.run_key, retrain.run_key)
    assert request.tags["batchrl/changed_files"] == f"drop_002.jsonl@{digest[:12]}"  # only the new file
    assert _partitions(new) == [("AddDynamicPartitionsRequest", ["drop_002.jsonl"])]

    os.remove(tmp_path / "prefs" / "drop_002.jsonl")
    back, _ = _evaluate(landing, cursor)
    (request,) = back.run_requests  # same content as the first run: the same run key (Dagster skips it)
    assert request.run_key == retrain.run_key and request.partition_key is None
    assert dg.AssetKey("preference_window") in request.asset_selection and PER_DROP[0] not in request.asset_selection
    assert _partitions(back) == [("DeleteDynamicPartitionsRequest", ["drop_002.jsonl"])]


def test_new_thumbs_or_scored_logs_retrain_every_stage_that_reads_them(tmp_path):
    for name in ("scored", "feedback"):
        shutil.copytree(getattr(SAMPLES, name), tmp_path / name)
    landing = LandingResource(scored=str(tmp_path / "scored"), feedback=str(tmp_path / "feedback"))
    _, cursor = _evaluate(landing, None)
    for name, asset in (("feedback", "kto_checkpoint"), ("scored", "offline_policy_checkpoint")):
        with open(tmp_path / name / "new.jsonl", "w") as f:  # rows are not read here: any new bytes retrain
            f.write(json.dumps({"prompt": "q", "completion": "a", "label": True}) + "\n")
        result, cursor = _evaluate(landing, cursor)
        (request,) = result.run_requests  # no new drop: the training stages on the drops there are
        assert request.partition_key is None and "new.jsonl@" in request.tags["batchrl/changed_files"]
        assert {dg.AssetKey(asset), dg.AssetKey(f"{name}_logs")} <= set(request.asset_selection)
        assert PER_DROP[0] not in request.asset_selection


def test_s3_landing_prefixes(s3_options, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("sensor-bucket")
    fs.put(SAMPLES.preferences, "sensor-bucket/landing/preferences", recursive=True)
    fs.put(SAMPLES.scored, "sensor-bucket/landing/scored", recursive=True)
    fs.put(SAMPLES.feedback, "sensor-bucket/landing/feedback", recursive=True)
    fs.put(SAMPLES.prompts, "sensor-bucket/landing/train.jsonl")
    landing = LandingResource(preferences="s3://sensor-bucket/landing/preferences",
                              scored="s3://sensor-bucket/landing/scored",
                              feedback="s3://sensor-bucket/landing/feedback",
                              prompts="s3://sensor-bucket/landing/train.jsonl", storage_options=s3_options)
    first, cursor = _evaluate(landing, None)
    assert [r.partition_key for r in first.run_requests] == ["prefs_000.jsonl", "prefs_001.jsonl"]
    assert all(uri.startswith("s3://sensor-bucket/landing/") for uri in json.loads(cursor)["files"])
    assert _evaluate(landing, cursor)[0].skip_reason
    digest = _write(tmp_path / "drop.jsonl", 3)
    fs.put(str(tmp_path / "drop.jsonl"), "sensor-bucket/landing/preferences/drop_003.jsonl")
    new, _ = _evaluate(landing, cursor)
    (request,) = new.run_requests
    assert request.partition_key == "drop_003.jsonl" and request.tags["batchrl/changed_files"] == f"drop_003.jsonl@{digest[:12]}"
    for part in ("part-0", "part-1"):  # a folder of objects under the landing is one drop (an object batch)
        fs.put(str(tmp_path / "drop.jsonl"), f"sensor-bucket/landing/preferences/batch_004/{part}.jsonl")
    batch, _ = _evaluate(landing, _)
    assert [r.partition_key for r in batch.run_requests] == ["batch_004"]


def test_batchrl_run_hashes_only_the_landed_files_new_or_changed_since_it_last_looked(tmp_path, monkeypatch):
    """``drops_to_ingest`` (what `batchrl run` runs first) keeps each landed file's size, stamp and sha256 in
    the instance: the next look, in this process or the next command's, reads only new or changed files."""
    from batchrl.common import fsutil
    from batchrl.runs import log_drops

    shutil.copytree(SAMPLES.preferences, tmp_path / "prefs")
    defs = dg.Definitions(resources={"landing": LandingResource(preferences=str(tmp_path / "prefs"))})
    hashed = []
    real_hash = fsutil.sha256_file
    monkeypatch.setattr(fsutil, "sha256_file", lambda fs, path, *a: hashed.append(os.path.basename(path))
                        or real_hash(fs, path, *a))

    def look(instance) -> dict[str, str]:
        hashed.clear()
        return log_drops.drops_to_ingest(defs, instance)

    home = str(tmp_path / "home")
    os.makedirs(home)
    with dg.DagsterInstance.local_temp(tempdir=home) as instance:
        first = look(instance)
        assert set(first) == {"prefs_000.jsonl", "prefs_001.jsonl"} and "prefs_000.jsonl" in hashed
        every_file = sorted(hashed)  # the drops, and the landing's scored logs and prompts
        assert look(instance) == first and hashed == []
    with dg.DagsterInstance.local_temp(tempdir=home) as instance:  # the next command
        assert look(instance) == first and hashed == []
        os.utime(tmp_path / "prefs" / "prefs_000.jsonl", (1, 1))  # touched, same bytes: read, same content
        assert look(instance) == first and hashed == ["prefs_000.jsonl"]
        with open(tmp_path / "prefs" / "prefs_001.jsonl", "a") as f:
            f.write(json.dumps({"prompt": "new", "chosen": "a", "rejected": "b"}) + "\n")
        changed = look(instance)
        assert hashed == ["prefs_001.jsonl"] and changed["prefs_001.jsonl"] != first["prefs_001.jsonl"]
        key = log_drops.landing_state_key(defs.resources["landing"])
        instance.run_storage.set_cursor_values({key: "{not json"})  # damaged: everything is read again
        assert look(instance) == changed and sorted(hashed) == every_file


def test_the_ingested_drops_content_keys_in_one_pass_the_latest_of_each(tmp_path):
    from batchrl.runs.log_drops import ingested_contents

    os.makedirs(tmp_path / "home")
    with dg.DagsterInstance.local_temp(tempdir=str(tmp_path / "home")) as instance:
        for drop, content in [("a", "1"), ("b", "1"), ("c", "1"), ("a", "2"), ("d", "1"), ("b", "3")]:
            instance.report_runless_asset_event(dg.AssetMaterialization(
                asset_key="raw_logs", partition=drop, metadata={"drop_content": content}))
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="cleaned_logs", partition="e"))
        assert ingested_contents(instance, page=2) == {"a": "2", "b": "3", "c": "1", "d": "1"}  # across pages
