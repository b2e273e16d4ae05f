"""Jobs and automation: the new-logs sensor (log drops become partitions; landed files whose bytes changed are
ingested again) and declarative automation (``AutomationCondition``, evaluated by ``automation_sensor``): each
registered drop is ingested once, and at 03:00 the training stages retrain on what is new. All off by default."""

import hashlib
import json
import os

import dagster as dg

from batchrl.assets.data import DROP_CONTENT_TAG
from batchrl.assets.drops import LOG_DROPS, PER_DROP_ASSETS, drop_of, landing_drops
from batchrl.common import fsutil
from batchrl.resources import LandingResource
from batchrl.resources.landing import LANDING_INPUT_KEY

PER_DROP = [dg.AssetKey(name) for name in PER_DROP_ASSETS]
retrain_job = dg.define_asset_job("retrain", selection=dg.AssetSelection.all(),
                                  description="Every asset, end to end (per-drop assets for the run's log drop)")
ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.groups("data"),
                                 description="Landing logs to validated pairs and the training window")
#: the landing locations the sensor watches (the held-out prompts are read by ``evaluation`` when it runs)
WATCHED = ("preferences", "scored", "feedback", "prompts")
RETRAIN_CRON = "0 3 * * *"  # UTC, as the schedule it replaces
#: the RL loop's back edge (materialised by ``policy_checkpoint``, withdrawn by the promotion check): a checkpoint
#: the last retrain made is no new input for the next one
LOOP_BACK_EDGE = dg.AssetSelection.assets("promoted_policy")


def _listing(landing: LandingResource) -> dict[str, tuple[dict, object, str, str]]:
    """Every landed log of the watched locations (folders, files or s3:// prefixes): uri -> (info, fs, path,
    location). A location with nothing landed holds no logs (a team may land only some kinds)."""
    out = {}
    for location in WATCHED:
        uri = getattr(landing, location)
        fs, path = fsutil.filesystem_for(uri, landing.storage_options)
        if not fs.exists(path):
            continue
        files = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
        prefix = uri.split("://", 1)[0] + "://" if "://" in uri else ""
        for name, info in sorted(files.items()):
            out[prefix + name] = (info, fs, name, location)
    return out


def landing_state(landing: LandingResource, previous: dict[str, dict] | None = None) -> dict[str, dict]:
    """uri -> {size, stamp, sha256, location} of every landed log. Listing is cheap; only files whose size or
    modification stamp changed since ``previous`` are hashed again."""
    previous = previous or {}
    state = {}
    for uri, (info, fs, path, location) in _listing(landing).items():
        stamp = str(info.get("mtime") or info.get("LastModified") or info.get("ETag") or "")
        known = previous.get(uri, {})
        same = known.get("size") == info.get("size") and known.get("stamp") == stamp and known.get("sha256")
        state[uri] = {"size": info.get("size"), "stamp": stamp, "location": location,
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


def _landing_readers() -> dict[str, dg.AssetKey]:
    """location -> the unpartitioned asset that ingests it (its ``batchrl/landing_input`` metadata), for the
    watched locations other than the drops."""
    from batchrl.assets import data, rl

    return {spec.metadata[LANDING_INPUT_KEY]: spec.key for a in dg.load_assets_from_modules([data, rl])
            for spec in a.specs if spec.partitions_def is None
            and spec.metadata.get(LANDING_INPUT_KEY) in WATCHED}


def _changed_names(uris: list[str], state: dict[str, dict]) -> str:
    return ", ".join(f"{os.path.basename(uri)}@{state[uri]['sha256'][:12]}" for uri in uris)[:1000]


@dg.sensor(job=retrain_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Registers each log drop of the landing as a partition (automation_sensor ingests it) and "
                       "removes drops gone; a landed file whose bytes changed (a drop sent again, new scored logs, "
                       "thumbs or prompts) is ingested again once (run key = its content)")
def new_logs_sensor(context: dg.SensorEvaluationContext, landing: LandingResource):
    """What no automation condition can see: the landing's files. New drops become ``log_drops`` partitions
    (``automation_sensor`` ingests them); drops gone are removed (their artifacts stay). A drop whose content
    changed is ingested again (run key ``<drop>@<content>``: never twice for the same bytes, a touched but
    unchanged file not at all), and so is the asset of a scored/feedback/prompts location whose files changed;
    the nightly retrain takes them up. The cursor keeps each file's size, stamp and sha256 so only changed files
    are hashed again. Local folders and s3:// prefixes alike."""
    previous = _read_cursor(context.cursor)
    state = landing_state(landing, previous.get("files"))
    key, drops = content_key(state), landing_drops(landing, state)
    cursor = json.dumps({"content": key, "files": state, "drops": drops}, sort_keys=True)
    if key == previous.get("content"):
        return dg.SensorResult(skip_reason=f"landing content unchanged ({key})", cursor=cursor)
    before, seen = previous.get("files", {}), previous.get("drops", {})
    changed = [uri for uri, entry in state.items() if before.get(uri, {}).get("sha256") != entry["sha256"]]
    requests = [dg.RunRequest(run_key=f"{drop}@{content}", partition_key=drop, asset_selection=list(PER_DROP),
                              tags={DROP_CONTENT_TAG: content, "batchrl/changed_files": _changed_names(
                                  [uri for uri in changed if drop_of(landing, uri) == drop], state)})
                for drop, content in drops.items() if drop in seen and seen[drop] != content]
    for location, asset in _landing_readers().items():
        ingest = [uri for uri in changed if state[uri]["location"] == location]
        if ingest:  # files of the location new or changed: its content (run key) names every file in it
            content = content_key({uri: e for uri, e in state.items() if e["location"] == location})
            requests.append(dg.RunRequest(run_key=f"{asset.to_user_string()}@{content}", asset_selection=[asset],
                                          tags={"batchrl/changed_files": _changed_names(ingest, state)}))
    known = set(context.instance.get_dynamic_partitions(LOG_DROPS.name)) if context.instance_ref else set(seen)
    new = [drop for drop in drops if drop not in known]
    gone = [drop for drop in seen if drop not in drops]
    partitions = [LOG_DROPS.build_add_request(new)] if new else []
    partitions += [LOG_DROPS.build_delete_request(gone)] if gone else []
    return dg.SensorResult(run_requests=requests, cursor=cursor, dynamic_partitions_requests=partitions)


def ingest_drop_condition() -> dg.AutomationCondition:
    """Per drop: a registered drop not ingested yet is ingested, once. Not ``eager()``: its ``newly_missing``
    sees only partitions added after the condition's first evaluation, so drops that ``new_logs_sensor``
    registered before automation was switched on would wait forever. A drop whose ingest failed is not retried
    (``new_logs_sensor`` ingests it again when its bytes change)."""
    condition = dg.AutomationCondition
    return (condition.missing() & ~condition.in_progress() & ~condition.execution_failed()).with_label(
        "registered drop not ingested yet")


def _new_input() -> dg.AutomationCondition:
    """Evaluated on an input (a drop's partition, for the training window): materialised since the last
    evaluation by a run that did not also make this asset, and every blocking check of it passed, so a drop
    that failed its reject-rate gate is no new data. A check that reports after the tick that saw its
    materialisation counts when it passes (``newly_true``)."""
    condition = dg.AutomationCondition
    passed = condition.all_checks_match(condition.check_passed(), blocking_only=True)
    updated = condition.newly_updated() & ~condition.executed_with_root_target()
    return ((updated | passed.newly_true()) & passed).with_label("updated, blocking checks passed")


def retrain_condition(cron: str = RETRAIN_CRON) -> dg.AutomationCondition:
    """The nightly retrain: at the cron tick, an asset is requested when one of its inputs has new data since
    it was last requested or materialised (``_new_input``), or an input is requested at the same tick; every
    stage downstream of a new drop follows in one run. ``promoted_policy`` is no input here (else each retrain
    would ask for the next). A retrain that failed runs again with the next new data (or by hand). Not
    ``on_cron()``: that waits for *every* input to update after the tick."""
    condition = dg.AutomationCondition
    new_data = condition.any_deps_match(_new_input()).ignore(LOOP_BACK_EDGE).since_last_handled()
    input_requested = condition.any_deps_match(condition.will_be_requested()).ignore(LOOP_BACK_EDGE)
    return (condition.cron_tick_passed(cron) & (new_data | input_requested) & ~condition.in_progress()).with_label(
        f"retrain at '{cron}' (UTC) on new input")


def with_automation(assets: list) -> list:
    """The assets with their automation conditions: the per-drop assets ingest each registered drop; every
    other asset with an input retrains at the nightly tick on new input. Assets without inputs (scored logs,
    thumbs, prompts: ingested by ``new_logs_sensor`` when their files change) and external ones have none."""
    def condition(spec: dg.AssetSpec) -> dg.AssetSpec:
        if spec.partitions_def == LOG_DROPS:
            return spec.replace_attributes(automation_condition=ingest_drop_condition())
        return spec.replace_attributes(automation_condition=retrain_condition()) if spec.deps else spec

    return [a if isinstance(a, dg.AssetSpec) else a.map_asset_specs(condition) for a in assets]


automation_sensor = dg.AutomationConditionSensorDefinition(
    "automation_sensor", target=dg.AssetSelection.all(), default_status=dg.DefaultSensorStatus.STOPPED,
    minimum_interval_seconds=30,
    description="Declarative automation: ingests each log drop that new_logs_sensor registered, once; at 03:00 "
                "(UTC) retrains the stages whose inputs have new data (a failed blocking check is no new data)")
