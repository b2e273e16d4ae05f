"""The new-logs sensor keys runs by landing *content*: a new or changed file retrains once, a touched but
unchanged file does not, only changed files are hashed again; local folders and s3:// prefixes alike."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import dagster as dg

from batchrl.assets.automation import new_logs_sensor
from batchrl.resources import LandingResource

SAMPLES = LandingResource()


def _evaluate(landing: LandingResource, cursor: str | None):
    context = dg.build_sensor_context(cursor=cursor, resources={"landing": landing})
    return new_logs_sensor(context), context.cursor


def _write(path, rows: int, start: int = 0) -> str:
    with open(path, "w") as f:
        f.write("".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n"
                        for i in range(start, start + rows)))
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_runs_are_keyed_by_content_not_by_timestamps(tmp_path):
    shutil.copytree(SAMPLES.preferences, tmp_path / "prefs")
    landing = LandingResource(preferences=str(tmp_path / "prefs"))
    first, cursor = _evaluate(landing, None)
    assert isinstance(first, dg.RunRequest) and "prefs_000.jsonl@" in first.tags["batchrl/changed_files"]
    assert json.loads(cursor)["content"] == first.run_key

    again, cursor = _evaluate(landing, cursor)
    assert isinstance(again, dg.SkipReason)
    os.utime(tmp_path / "prefs" / "prefs_000.jsonl", (1, 1))  # touched, same bytes
    touched, touched_cursor = _evaluate(landing, cursor)
    assert isinstance(touched, dg.SkipReason)
    assert json.loads(touched_cursor)["files"] != json.loads(cursor)["files"]  # new stamp remembered

    digest = _write(tmp_path / "prefs" / "drop_002.jsonl", 5)
    new, cursor = _evaluate(landing, touched_cursor)
    assert isinstance(new, dg.RunRequest) and new.run_key != first.run_key
    assert new.tags["batchrl/changed_files"] == f"drop_002.jsonl@{digest[:12]}"  # only the new file

    os.remove(tmp_path / "prefs" / "drop_002.jsonl")
    back, _ = _evaluate(landing, cursor)
    assert isinstance(back, dg.RunRequest) and back.run_key == first.run_key  # same content as the first run


def test_s3_landing_prefixes(s3_options, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("sensor-bucket")
    fs.put(SAMPLES.preferences, "sensor-bucket/landing/preferences", recursive=True)
    fs.put(SAMPLES.scored, "sensor-bucket/landing/scored", recursive=True)
    fs.put(SAMPLES.prompts, "sensor-bucket/landing/train.jsonl")
    landing = LandingResource(preferences="s3://sensor-bucket/landing/preferences",
                              scored="s3://sensor-bucket/landing/scored",
                              prompts="s3://sensor-bucket/landing/train.jsonl", storage_options=s3_options)
    first, cursor = _evaluate(landing, None)
    assert isinstance(first, dg.RunRequest)
    assert all(uri.startswith("s3://sensor-bucket/landing/") for uri in json.loads(cursor)["files"])
    assert isinstance(_evaluate(landing, cursor)[0], dg.SkipReason)
    digest = _write(tmp_path / "drop.jsonl", 3)
    fs.put(str(tmp_path / "drop.jsonl"), "sensor-bucket/landing/preferences/drop_003.jsonl")
    new, _ = _evaluate(landing, cursor)
    assert isinstance(new, dg.RunRequest) and new.tags["batchrl/changed_files"] == f"drop_003.jsonl@{digest[:12]}"
