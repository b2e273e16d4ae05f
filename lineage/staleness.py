"""Which assets are stale, and why, as Dagster judges it (code version or upstream data changed).

The UI shows the same thing; this is the CLI/test view (``batchrl stale``).
"""
from __future__ import annotations

import dagster as dg

from batchrl.common import dagster_internals


def stale_causes(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[str, list[dict]]:
    """``{asset: [{"category": CODE|DATA|DEPENDENCIES, "key": asset the cause is on, "reason": ...}]}``
    for every materialised asset that Dagster reports stale (never-materialised assets are left out)."""
    causes = dagster_internals.stale_causes(defs, instance)
    return {key.to_user_string(): [{**cause, "key": cause["key"].to_user_string()} for cause in causes[key]]
            for key in sorted(causes, key=lambda k: k.to_user_string())}


def code_stale(causes: dict[str, list[dict]]) -> set[str]:
    """Assets stale because their *own* code version changed (not an upstream's)."""
    return {asset for asset, found in causes.items()
            if any(c["category"] == "CODE" and c["key"] == asset for c in found)}
