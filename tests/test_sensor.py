"""The new-logs sensor registers the landing's log drops as partitions (the automation sensor ingests them) and
ingests again what changed, keyed by *content*: a changed drop or location once, a touched but unchanged file
not at all, only changed files hashed again; local folders and s3:// prefixes alike."""
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
LANDING_ASSETS = {"scored_logs", "feedback_logs", "prompts"}  # the unpartitioned assets that read the landing


def _evaluate(landing: LandingResource, cursor: str | None) -> tuple[dg.SensorResult, str]:
    result = new_logs_sensor(dg.build_sensor_context(cursor=cursor, resources={"landing": landing}))
    return result, result.cursor


def _partitions(result: dg.SensorResult) -> list[tuple[str, list[str]]]:
    return [(type(r).__name__, list(r.partition_keys)) for r in result.dynamic_partitions_requests or []]


def _assets(request: dg.RunRequest) -> set[str]:
    return {key.to_user_string() for key in request.asset_selection}


def _write(path, rows: int, start: int = 0) -> str:
    with open(path, "w") as f:
        f.write("".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n"
                        for i in range(start, start + rows)))
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_drops_are_registered_and_changed_content_ingested_once(tmp_path):
    shutil.copytree(SAMPLES.preferences, tmp_path / "prefs")
    landing = LandingResource(preferences=str(tmp_path / "prefs"))
    first, cursor = _evaluate(landing, None)
    assert _partitions(first) == [("AddDynamicPartitionsRequest", ["prefs_000.jsonl", "prefs_001.jsonl"])]
    # new drops are the automation sensor's to ingest; the other locations, seen for the first time, are ingested
    assert sorted(tuple(_assets(r)) for r in first.run_requests) == [(a,) for a in sorted(LANDING_ASSETS)]
    assert all(r.partition_key is None for r in first.run_requests)

    again, cursor = _evaluate(landing, cursor)
    assert again.skip_reason and not again.run_requests and not _partitions(again)
    os.utime(tmp_path / "prefs" / "prefs_000.jsonl", (1, 1))  # touched, same bytes
    touched, touched_cursor = _evaluate(landing, cursor)
    assert touched.skip_reason and not touched.run_requests
    assert json.loads(touched_cursor)["files"] != json.loads(cursor)["files"]  # new stamp remembered

    _write(tmp_path / "prefs" / "drop_002.jsonl", 5)
    new, cursor = _evaluate(landing, touched_cursor)
    assert not new.run_requests and _partitions(new) == [("AddDynamicPartitionsRequest", ["drop_002.jsonl"])]

    digest = _write(tmp_path / "prefs" / "prefs_000.jsonl", 7)  # the drop sent again with other rows
    changed, changed_cursor = _evaluate(landing, cursor)
    (request,) = changed.run_requests  # only that drop, ingested again; nothing registered
    assert request.partition_key == "prefs_000.jsonl" and request.asset_selection == PER_DROP
    assert request.run_key == f"prefs_000.jsonl@{request.tags[DROP_CONTENT_TAG]}"
    assert request.tags["batchrl/changed_files"] == f"prefs_000.jsonl@{digest[:12]}"  # only the changed file
    assert not _partitions(changed)

    os.remove(tmp_path / "prefs" / "drop_002.jsonl")
    back, _ = _evaluate(landing, changed_cursor)
    assert not back.run_requests and _partitions(back) == [("DeleteDynamicPartitionsRequest", ["drop_002.jsonl"])]


def test_new_thumbs_or_scored_logs_are_ingested_again(tmp_path):
    """The asset that reads the location runs again (run key: the location's content); the nightly retrain
    then takes up what reads it."""
    for name in ("scored", "feedback"):
        shutil.copytree(getattr(SAMPLES, name), tmp_path / name)
    landing = LandingResource(scored=str(tmp_path / "scored"), feedback=str(tmp_path / "feedback"))
    _, cursor = _evaluate(landing, None)
    keys = set()
    for name in ("feedback", "scored"):
        with open(tmp_path / name / "new.jsonl", "w") as f:  # rows are not read here: any new bytes count
            f.write(json.dumps({"prompt": "q", "completion": "a", "label": True}) + "\n")
        result, cursor = _evaluate(landing, cursor)
        (request,) = result.run_requests
        assert _assets(request) == {f"{name}_logs"} and request.partition_key is None
        assert request.tags["batchrl/changed_files"].startswith("new.jsonl@")
        keys.add(request.run_key)
    assert len(keys) == 2


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
    assert _partitions(first) == [("AddDynamicPartitionsRequest", ["prefs_000.jsonl", "prefs_001.jsonl"])]
    assert {a for r in first.run_requests for a in _assets(r)} == LANDING_ASSETS
    assert all(uri.startswith("s3://sensor-bucket/landing/") for uri in json.loads(cursor)["files"])
    assert _evaluate(landing, cursor)[0].skip_reason
    _write(tmp_path / "drop.jsonl", 3)
    fs.put(str(tmp_path / "drop.jsonl"), "sensor-bucket/landing/preferences/drop_003.jsonl")
    new, cursor = _evaluate(landing, cursor)
    assert _partitions(new) == [("AddDynamicPartitionsRequest", ["drop_003.jsonl"])] and not new.run_requests
    for part in ("part-0", "part-1"):  # a folder of objects under the landing is one drop (an object batch)
        fs.put(str(tmp_path / "drop.jsonl"), f"sensor-bucket/landing/preferences/batch_004/{part}.jsonl")
    batch, cursor = _evaluate(landing, cursor)
    assert _partitions(batch) == [("AddDynamicPartitionsRequest", ["batch_004"])]
    digest = _write(tmp_path / "part.jsonl", 4)
    fs.put(str(tmp_path / "part.jsonl"), "sensor-bucket/landing/preferences/batch_004/part-1.jsonl")
    (request,) = _evaluate(landing, cursor)[0].run_requests  # one object of the batch changed: the batch again
    assert request.partition_key == "batch_004"
    assert request.tags["batchrl/changed_files"] == f"part-1.jsonl@{digest[:12]}"


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
