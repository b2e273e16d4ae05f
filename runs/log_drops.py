"""Which log drops of the landing a run still has to ingest: the landed files' states kept in the instance (only
new or changed files are hashed again), every drop registered as a ``log_drops`` partition, and the content
each drop's latest ``raw_logs`` recorded."""
from __future__ import annotations

import hashlib
import json

import dagster as dg

from batchrl.assets.automation import landing_state, register_drops
from batchrl.assets.drops import landing_drops

LANDING_STATE_KEY = "batchrl/landing_state/"


def landing_state_key(landing) -> str:
    """The instance's key-value entry that holds ``landing``'s file states (one per set of landing locations)."""
    locations = json.dumps([landing.preferences, landing.scored, landing.prompts])
    return LANDING_STATE_KEY + hashlib.sha256(locations.encode()).hexdigest()[:16]


def drops_to_ingest(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[str, str]:
    """The landing's log drops (drop -> content key) not yet ingested with that content; every landed
    drop is registered as a ``log_drops`` partition (in landing order), a drop gone from the landing removed.
    Each landed file's size, stamp and sha256 are kept in the instance (the sensor keeps them in its cursor),
    so only files new or changed since the last call are read: a landing of many gigabytes is not hashed
    again by every `batchrl run` (twice, before this: once to count the drops, once to run them)."""
    landing = defs.resources["landing"]
    key = landing_state_key(landing)
    try:
        previous = json.loads(instance.run_storage.get_cursor_values({key}).get(key) or "{}")
    except ValueError:  # not JSON: hash everything again
        previous = {}
    state = landing_state(landing, previous)
    if state != previous:
        instance.run_storage.set_cursor_values({key: json.dumps(state, sort_keys=True)})
    drops = landing_drops(landing, state)
    register_drops(instance, list(drops))
    ingested = ingested_contents(instance)
    return {drop: content for drop, content in drops.items() if ingested.get(drop) != content}


def ingested_contents(instance: dg.DagsterInstance, page: int = 1000) -> dict[str, str | None]:
    """Drop -> the content key its latest ``raw_logs`` recorded, for every ingested drop: one pass over the
    materialisations, newest first (a query per drop took ~3 ms: a year of daily drops, ~1 s a look)."""
    latest: dict[str, str | None] = {}
    cursor = None
    while True:
        result = instance.fetch_materializations(dg.AssetKey("raw_logs"), limit=page, cursor=cursor)
        for record in result.records:
            materialization = record.asset_materialization
            if materialization.partition not in latest:
                value = materialization.metadata.get("drop_content")
                latest[materialization.partition] = getattr(value, "value", value)
        if not result.has_more:
            return latest
        cursor = result.cursor
