"""Jobs, the new-logs sensor and the nightly retrain schedule."""

import hashlib
import json
import os

import dagster as dg

from batchrl import fsutil
from batchrl.resources import LandingResource

retrain_job = dg.define_asset_job("retrain", selection=dg.AssetSelection.all(), description="Every asset, end to end")
ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.groups("data"),
                                 description="Landing logs to validated pairs only")


def _listing(landing: LandingResource) -> dict[str, tuple[dict, object, str]]:
    """Every landed log (preferences, scored, prompts; folders, files or s3:// prefixes): uri -> (info, fs, path)."""
    out = {}
    for uri in (landing.preferences, landing.scored, landing.prompts):
        fs, path = fsutil.filesystem_for(uri, landing.storage_options)
        files = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
        prefix = uri.split("://", 1)[0] + "://" if "://" in uri else ""
        for name, info in sorted(files.items()):
            out[prefix + name] = (info, fs, name)
    return out


def landing_state(landing: LandingResource, previous: dict[str, dict] | None = None) -> dict[str, dict]:
    """uri -> {size, stamp, sha256} of every landed log. Listing is cheap; only files whose size or
    modification stamp changed since ``previous`` are hashed again."""
    previous = previous or {}
    state = {}
    for uri, (info, fs, path) in _listing(landing).items():
        stamp = str(info.get("mtime") or info.get("LastModified") or info.get("ETag") or "")
        known = previous.get(uri, {})
        same = known.get("size") == info.get("size") and known.get("stamp") == stamp and known.get("sha256")
        state[uri] = {"size": info.get("size"), "stamp": stamp,
                      "sha256": known["sha256"] if same else fsutil.sha256_file(fs, path)}
    return state


def content_key(state: dict[str, dict]) -> str:
    """Hash of the landing's content (file names and sha256s): the sensor's run key."""
    digest = hashlib.sha256()
    for uri, entry in sorted(state.items()):
        digest.update(f"{uri}\0{entry['sha256']}\n".encode())
    return digest.hexdigest()[:16]


def _read_cursor(cursor: str | None) -> dict:
    if not cursor:
        return {}
    try:
        return json.loads(cursor)
    except ValueError:  # a bare content key (an older cursor, or a run key handed back)
        return {"content": cursor}


@dg.sensor(job=retrain_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED)
def new_logs_sensor(context: dg.SensorEvaluationContext, landing: LandingResource):
    """Retrain when the landing's *content* changes: run key = content hash (the same content never
    retrains twice, a touched but unchanged file not at all); the cursor keeps each file's size, stamp and
    sha256 so only changed files are hashed again. Works on local folders and s3:// prefixes alike."""
    previous = _read_cursor(context.cursor)
    state = landing_state(landing, previous.get("files"))
    key = content_key(state)
    context.update_cursor(json.dumps({"content": key, "files": state}, sort_keys=True))
    if key == previous.get("content"):
        return dg.SkipReason(f"landing content unchanged ({key})")
    before = previous.get("files", {})
    changed = [uri for uri, entry in state.items() if before.get(uri, {}).get("sha256") != entry["sha256"]]
    names = ", ".join(f"{os.path.basename(uri)}@{state[uri]['sha256'][:12]}" for uri in changed)
    return dg.RunRequest(run_key=key, tags={"batchrl/landing_content": key,
                                            "batchrl/changed_files": names[:1000] or "(files removed)"})


nightly_retrain = dg.ScheduleDefinition(name="nightly_retrain", job=retrain_job, cron_schedule="0 3 * * *",
                                        default_status=dg.DefaultScheduleStatus.STOPPED)
