"""Which assets are stale, and why, as Dagster judges it (code version or upstream data changed).

The UI shows the same thing; this is the CLI/test view (``batchrl stale``).
"""
from __future__ import annotations

import dagster as dg


def stale_causes(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[str, list[dict]]:
    """``{asset: [{"category": CODE|DATA|DEPENDENCIES, "key": asset the cause is on, "reason": ...}]}``
    for every materialised asset that Dagster reports stale (never-materialised assets are left out)."""
    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._time import get_current_datetime

    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance=instance, asset_graph=graph, loading_context=view)
    out = {}
    for key in sorted(graph.materializable_asset_keys, key=lambda k: k.to_user_string()):
        if resolver.get_status(key) == StaleStatus.STALE:
            out[key.to_user_string()] = [{"category": c.category.value, "key": c.key.asset_key.to_user_string(),
                                          "reason": c.reason} for c in resolver.get_stale_causes(key)]
    return out


def code_stale(causes: dict[str, list[dict]]) -> set[str]:
    """Assets stale because their *own* code version changed (not an upstream's)."""
    return {asset for asset, found in causes.items()
            if any(c["category"] == "CODE" and c["key"] == asset for c in found)}
