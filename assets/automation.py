"""Jobs, the new-logs sensor and the nightly retrain schedule."""

import hashlib

import dagster as dg

from batchrl import fsutil
from batchrl.resources import LandingResource

retrain_job = dg.define_asset_job("retrain", selection=dg.AssetSelection.all(), description="Every asset, end to end")
ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.groups("data"),
                                 description="Landing logs to validated pairs only")


def landing_fingerprint(landing: LandingResource) -> str:
    """Names, sizes and modification stamps of every landed log: cheap to list, changes on any new drop."""
    digest = hashlib.sha256()
    for uri in (landing.preferences, landing.scored, landing.prompts):
        fs, path = fsutil.filesystem_for(uri, landing.storage_options)
        files = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
        for name, info in sorted(files.items()):
            stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag") or ""
            digest.update(f"{name}\0{info.get('size')}\0{stamp}\n".encode())
    return digest.hexdigest()[:16]


@dg.sensor(job=retrain_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED)
def new_logs_sensor(context: dg.SensorEvaluationContext, landing: LandingResource):
    """Retrain when the landing place changes (a new or modified log file)."""
    fingerprint = landing_fingerprint(landing)
    if fingerprint == context.cursor:
        return dg.SkipReason(f"landing unchanged ({fingerprint})")
    context.update_cursor(fingerprint)
    return dg.RunRequest(run_key=fingerprint, tags={"batchrl/landing_fingerprint": fingerprint})


nightly_retrain = dg.ScheduleDefinition(name="nightly_retrain", job=retrain_job, cron_schedule="0 3 * * *",
                                        default_status=dg.DefaultScheduleStatus.STOPPED)
