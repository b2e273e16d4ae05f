"""Which numbers of a materialisation the UI plots. Dagster draws every numeric metadata key as a series in the
asset's Plots tab; run details that are numbers but measure nothing of the asset (the seeds, the hashing time,
the world size, the job worker's weight-cache counts) are shown as text instead (the catalog and the lineage
keep them as numbers)."""
from __future__ import annotations

from typing import Any

NOT_PLOTTED = ("seed", "hash_s", "publish_s", "world_size", "prefetch_seed", "sample_ahead_seed")
NOT_PLOTTED_PREFIXES = ("weight_cache_", "step_s/")


def plotted(key: str) -> bool:
    return key not in NOT_PLOTTED and not key.startswith(NOT_PLOTTED_PREFIXES)


def numbers_as_text_when_not_plotted(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with the numbers of the keys the UI should not plot turned into text (a str, Dagster's text
    metadata); everything else unchanged."""
    return {key: str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and not plotted(key)
            else value for key, value in metadata.items()}
