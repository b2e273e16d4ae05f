"""Jobs, the new-logs sensor (log drops as partitions) and the nightly retrain schedule."""

import hashlib
import json
import os

import dagster as dg

from batchrl.assets.data import DROP_CONTENT_TAG
from batchrl.assets.drops import LOG_DROPS, PER_DROP_ASSETS, landing_drops
from batchrl.common import fsutil
from batchrl.resources import LandingResource

PER_DROP = [dg.AssetKey(name) for name in PER_DROP_ASSETS]
retrain_job = dg.define_asset_job("retrain", selection=dg.AssetSelection.all(),
                                  description="Every asset, end to end (per-drop assets for the run's log drop)")
ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.groups("data"),
                                 description="Landing logs to validated pairs and the training window")


def _listing(landing: LandingResource) -> dict[str, tuple[dict, object, str]]:
    """Every landed log (preferences, scored, feedback, prompts; folders, files or s3:// prefixes):
    uri -> (info, fs, path). A location with nothing landed holds no logs (a team may land only some kinds)."""
    out = {}
    for uri in (landing.preferences, landing.scored, landing.feedback, landing.prompts):
        fs, path = fsutil.filesystem_for(uri, landing.storage_options)
        if not fs.exists(path):
            continue
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


def register_drops(instance: dg.DagsterInstance, drops: list[str]) -> None:
    """Make the landed drops the ``log_drops`` partitions: new ones added (in the order given), drops
    gone from the landing removed (their artifacts stay; the training window no longer reads them)."""
    known = instance.get_dynamic_partitions(LOG_DROPS.name)
    if [d for d in drops if d not in known]:
        instance.add_dynamic_partitions(LOG_DROPS.name, [d for d in drops if d not in known])
    for drop in (d for d in known if d not in drops):
        instance.delete_dynamic_partition(LOG_DROPS.name, drop)


def _training_keys() -> list[dg.AssetKey]:
    """Every asset that is not per drop: what a retrain without a new drop materialises."""
    from batchrl.assets import data, dpo, evaluation, models, offline, rl

    assets = dg.load_assets_from_modules([data, models, rl, dpo, offline, evaluation])
    return sorted((key for a in assets if a.partitions_def is None for key in a.keys), key=str)


@dg.sensor(job=retrain_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Retrains when the landing's content changes: each new or changed log file becomes a log "
                       "drop (a partition) ingested once; the same content never retrains twice (run key = its hash)")
def new_logs_sensor(context: dg.SensorEvaluationContext, landing: LandingResource):
    """Retrain when the landing's *content* changes (run key = content hash: the same content never
    retrains twice, a touched but unchanged file not at all); the cursor keeps each file's size, stamp and
    sha256 so only changed files are hashed again. Each new or changed log drop becomes a ``log_drops``
    partition and is ingested once (run key = the drop's content); the last one's run retrains too, so
    old drops are never recomputed. Local folders and s3:// prefixes alike."""
    previous = _read_cursor(context.cursor)
    state = landing_state(landing, previous.get("files"))
    key, drops = content_key(state), landing_drops(landing, state)
    cursor = json.dumps({"content": key, "files": state, "drops": drops}, sort_keys=True)
    if key == previous.get("content"):
        return dg.SensorResult(skip_reason=f"landing content unchanged ({key})", cursor=cursor)
    before = previous.get("files", {})
    changed = [uri for uri, entry in state.items() if before.get(uri, {}).get("sha256") != entry["sha256"]]
    names = ", ".join(f"{os.path.basename(uri)}@{state[uri]['sha256'][:12]}" for uri in changed)
    new = [drop for drop, content in drops.items() if previous.get("drops", {}).get(drop) != content]
    requests = [dg.RunRequest(run_key=f"{drop}@{drops[drop]}", partition_key=drop, asset_selection=list(PER_DROP),
                              tags={DROP_CONTENT_TAG: drops[drop]}) for drop in new[:-1]]
    tags = {"batchrl/landing_content": key, "batchrl/changed_files": names[:1000] or "(files removed)"}
    if new:  # the newest drop and everything downstream of the drops in one run
        requests.append(dg.RunRequest(run_key=key, partition_key=new[-1], tags={**tags, DROP_CONTENT_TAG: drops[new[-1]]}))
    else:  # scored logs, thumbs or prompts changed, or a drop was removed: retrain on the drops there are
        requests.append(dg.RunRequest(run_key=key, asset_selection=_training_keys(), tags=tags))
    known = set(context.instance.get_dynamic_partitions(LOG_DROPS.name)) if context.instance_ref else set()
    gone = [drop for drop in previous.get("drops", {}) if drop not in drops]
    partitions = [LOG_DROPS.build_add_request([d for d in new if d not in known])] if new else []
    partitions += [LOG_DROPS.build_delete_request(gone)] if gone else []
    return dg.SensorResult(run_requests=requests, cursor=cursor, dynamic_partitions_requests=partitions)


def ingested_drops(instance: dg.DagsterInstance) -> list[str]:
    """The ``log_drops`` partitions whose ``validated_preferences`` is materialised, in landing order."""
    done = instance.get_materialized_partitions(dg.AssetKey("validated_preferences"))
    return [drop for drop in instance.get_dynamic_partitions(LOG_DROPS.name) if drop in done]


@dg.schedule(job=retrain_job, cron_schedule="0 3 * * *", default_status=dg.DefaultScheduleStatus.STOPPED,
             description="At 03:00, retrains the training stages on what is new: runs only when a log drop was "
                         "ingested that the latest preference_window did not consider")
def nightly_retrain(context: dg.ScheduleEvaluationContext):
    """Retrain at 03:00 on what is new: runs the training stages when a log drop was ingested that the
    latest ``preference_window`` did not consider (run key = the ingested drops, so once per new set)."""
    ingested = ingested_drops(context.instance)
    event = context.instance.get_latest_materialization_event(dg.AssetKey("preference_window"))
    metadata = event.asset_materialization.metadata if event else {}
    considered = {d for name in ("drops", "drops_failing_gate", "drops_outside_window")
                  for d in getattr(metadata.get(name), "value", None) or []}
    new = [drop for drop in ingested if drop not in considered]
    if not new:
        return dg.SkipReason(f"no new log drop since the last training window ({len(ingested)} ingested)")
    run_key = hashlib.sha256("\n".join(ingested).encode()).hexdigest()[:16]
    return dg.RunRequest(run_key=run_key, asset_selection=_training_keys(),
                         tags={"batchrl/new_drops": ", ".join(new)[:1000]})
