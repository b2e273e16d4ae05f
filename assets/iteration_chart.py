"""An RL chain's headline numbers against its iteration, as a chart on each ``promoted_policy`` materialisation.

Dagster's Plots tab draws a non-partitioned asset's numbers against the materialisation time, never against a
metadata key (docs/TRACKING.md). So at the end of every iteration the chain so far is drawn with the iteration on
the x-axis: the rewards (mean, min, max, spread, per component, per category), the rollouts (response length, stop
rate), the advantages (mean |A|) and the KL coefficients. The numbers come from the stages' own materialisations
in the instance, each tagged with its chain (``chain_base``) and iteration; a re-run iteration counts once, with
its newest numbers. The chart is drawn by a thread while the policy update runs, off the loop's critical path
(issue 32), as ``background_curves`` draws the per-step chart.
"""
from __future__ import annotations

import threading

import dagster as dg

from batchrl.assets.charts import line_panels
from batchrl.assets.policy_chain import CHAIN, ITERATION

STAGES = ("rollouts", "rewards", "advantages", "policy_checkpoint")
History = dict[str, dict[int, dict[str, float]]]  # {asset: {iteration: {key: number}}}
# panel title -> (asset, keys or a key prefix ending in "/")
PANELS: dict[str, list[tuple[str, str]]] = {
    "reward": [("rewards", "mean_reward"), ("rewards", "reward_min"), ("rewards", "reward_max")],
    "reward_std": [("rewards", "reward_std")],
    "reward by component": [("rewards", "mean_reward/")],
    "reward by category": [("rewards", "mean_reward_by_category/")],
    "mean |advantage|": [("advantages", "adv_abs_mean")],
    "KL coefficient": [("advantages", "kl_in_reward_coef"), ("policy_checkpoint", "kl_loss_coef")],
    "response tokens": [("rollouts", "mean_response_tokens")],
    "stop rate": [("rollouts", "stop_rate")],
}


def _number(value) -> float | None:
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def chain_history(instance: dg.DagsterInstance, chain: str, stages=STAGES, limit: int = 500) -> History:
    """Each stage's numbers per iteration of ``chain`` (``base_model@<data version>``), from its latest ``limit``
    materialisations; of an iteration materialised more than once, the newest."""
    history: History = {}
    for asset in stages:
        per_iteration: dict[int, dict[str, float]] = {}
        for record in instance.fetch_materializations(dg.AssetKey(asset), limit=limit).records:  # newest first
            metadata = record.asset_materialization.metadata
            if ITERATION not in metadata or str(getattr(metadata.get(CHAIN), "value", "")) != chain:
                continue
            iteration = int(metadata[ITERATION].value)
            if iteration not in per_iteration:
                per_iteration[iteration] = {k: n for k, v in metadata.items() if (n := _number(v)) is not None}
        history[asset] = per_iteration
    return history


def iteration_panels(history: History, upto: int | None = None) -> dict[str, dict[str, tuple[list, list]]]:
    """``line_panels``' input: per panel of PANELS, per key found, (iterations, values), iterations <= ``upto``."""
    panels: dict[str, dict[str, tuple[list, list]]] = {}
    for title, sources in PANELS.items():
        series: dict[str, tuple[list, list]] = {}
        for asset, key in sources:
            rows = sorted((i, numbers) for i, numbers in history.get(asset, {}).items() if upto is None or i <= upto)
            keys = sorted({k for _, numbers in rows for k in numbers if k.startswith(key)}) if key.endswith("/") \
                else [key]
            for name in keys:
                points = [(i, numbers[name]) for i, numbers in rows if name in numbers]
                if points:
                    series[name] = ([i for i, _ in points], [v for _, v in points])
        if series:
            panels[title] = series
    return panels


def chain_chart_metadata(instance: dg.DagsterInstance, chain: str, upto: int | None,
                         current: dict[str, dict[str, float]] | None = None) -> dict[str, dg.MetadataValue]:
    """``{"iterations_chart": image}`` of ``chain`` up to iteration ``upto``; ``current``: numbers of iteration
    ``upto`` not in the instance yet (``{asset: {key: number}}``). {} when there is nothing to draw."""
    history = chain_history(instance, chain)
    if upto is not None:
        for asset, numbers in (current or {}).items():
            history.setdefault(asset, {})[upto] = numbers
    panels = iteration_panels(history, upto)
    if not panels:
        return {}
    return {"iterations_chart": dg.MetadataValue.md(line_panels(panels, xlabel="iteration").markdown(
        "the RL chain per iteration"))}


class ChainChart:
    """``with ChainChart(instance, chain, upto, current) as chart: run the update``; then ``chart.metadata()``.

    The instance holds this iteration's rollouts, rewards and advantages by the time the update starts, so the
    chart is drawn while the update runs. A failure to draw is logged, never the iteration's failure."""

    def __init__(self, context: dg.AssetExecutionContext, chain: str, upto: int | None,
                 current: dict[str, dict[str, float]] | None = None) -> None:
        self._args = (context.instance, chain, upto, current)
        self._log = context.log
        self._drawn: dict[str, dg.MetadataValue] = {}
        self._thread = threading.Thread(target=self._draw, name="batchrl-chain-chart", daemon=True)

    def _draw(self) -> None:
        try:
            self._drawn = chain_chart_metadata(*self._args)
        except Exception as error:  # a chart must not fail the update it describes
            self._log.warning(f"iterations_chart not drawn: {type(error).__name__}: {error}")

    def __enter__(self) -> "ChainChart":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join()

    def metadata(self) -> dict[str, dg.MetadataValue]:
        return self._drawn
