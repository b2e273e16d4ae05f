"""An RL chain's headline numbers against its iteration, as a chart on each ``promoted_policy`` materialisation.

Dagster's Plots tab draws a non-partitioned asset's numbers against the materialisation time, never against a
metadata key (docs/TRACKING.md). So at the end of every iteration the chain so far is drawn with the iteration on
the x-axis: the rewards (mean, min, max, spread, per component, per category), the rollouts (response length, stop
rate), the advantages (mean |A|), the KL coefficients and, where ``evaluation`` ran during the chain (``batchrl run
--eval-every K``), the held-out accuracy, format, truncation and loop rates and answer length of the policy it
evaluated at that policy's iteration (its base model's at 0). The numbers come from the stages' own
materialisations in the instance, each tagged with its chain (``chain_base``) and iteration; a re-run iteration
counts once, with its newest numbers. The chart is drawn by a thread while the policy update runs, off the loop's
critical path (issue 32), as ``background_curves`` draws the per-step chart; an evaluation draws it too, with its
own numbers (the one after the last iteration is in no promotion's chart).
"""
from __future__ import annotations

import threading

import dagster as dg

from batchrl.assets.charts import line_panels
from batchrl.assets.policy_chain import CHAIN, ITERATION

STAGES = ("rollouts", "rewards", "advantages", "policy_checkpoint")
EVALUATION = "evaluation"
CHARTED = (*STAGES, EVALUATION)
# evaluation's numbers per model ("<model>/<metric>"): the evaluated policy's are charted at its iteration, the base
# model's at 0 when it is the chain's base (its text metadata EVALUATED_BASE: "base_model@<data version>")
POLICY_PREFIX, BASE_PREFIX, EVALUATED_BASE = "policy_checkpoint/", "base_model/", "evaluated_base_model"
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
    "held-out accuracy": [(EVALUATION, "arith_accuracy"), (EVALUATION, "format_rate")],
    # the policy's gain over the base model, question by question, with its 95% interval (training.evaluation.paired)
    "held-out gain over base (95%)": [(EVALUATION, "arith_gain"), (EVALUATION, "arith_gain_ci95_low"),
                                      (EVALUATION, "arith_gain_ci95_high")],
    "held-out truncation, loops": [(EVALUATION, "truncation_rate"), (EVALUATION, "loop_rate")],
    "held-out answer tokens": [(EVALUATION, "mean_answer_tokens")],
}


def _number(value) -> float | None:
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value) -> str:
    return str(getattr(value, "value", value))


def _points(asset: str, iteration: int, metadata: dict, chain: str) -> dict[int, dict[str, float]]:
    """A materialisation's numbers by the iteration they belong to: an RL stage's at its own; an evaluation's, the
    evaluated policy's at the policy's iteration (``<metric>``) and, when its base model is the chain's, the base
    model's at 0 (the chain before its first update)."""
    numbers = {k: n for k, v in metadata.items() if (n := _number(v)) is not None}
    if asset != EVALUATION:
        return {iteration: numbers}

    def of(prefix: str) -> dict[str, float]:
        return {k[len(prefix):]: n for k, n in numbers.items() if k.startswith(prefix)}

    base = {0: of(BASE_PREFIX)} if EVALUATED_BASE in metadata and _text(metadata[EVALUATED_BASE]) == chain else {}
    return {**base, iteration: of(POLICY_PREFIX)}


def chain_history(instance: dg.DagsterInstance, chain: str, stages=STAGES, limit: int = 500) -> History:
    """Each stage's numbers per iteration of ``chain`` (``base_model@<data version>``), from its latest ``limit``
    materialisations; of an iteration materialised more than once, the newest."""
    history: History = {}
    for asset in stages:
        per_iteration: dict[int, dict[str, float]] = {}
        for record in instance.fetch_materializations(dg.AssetKey(asset), limit=limit).records:  # newest first
            metadata = record.asset_materialization.metadata
            if ITERATION not in metadata or _text(metadata.get(CHAIN, "")) != chain:
                continue
            for at, numbers in _points(asset, int(metadata[ITERATION].value), metadata, chain).items():
                per_iteration.setdefault(at, numbers)
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
    ``upto`` not in the instance yet (``{asset: {key: number}}``; an evaluation's as its metadata, see
    ``_points``). {} when there is nothing to draw."""
    history = chain_history(instance, chain, CHARTED)
    if upto is not None:
        for asset, metadata in (current or {}).items():
            for at, numbers in _points(asset, upto, metadata, chain).items():
                history.setdefault(asset, {})[at] = numbers
    panels = iteration_panels(history, upto)
    if not panels:
        return {}
    return {"iterations_chart": dg.MetadataValue.md(line_panels(panels, xlabel="iteration").markdown(
        "the RL chain per iteration"))}


def drawn_or_logged(log, instance: dg.DagsterInstance, chain: str, upto: int | None,
                    current: dict[str, dict] | None = None) -> dict[str, dg.MetadataValue]:
    """``chain_chart_metadata``, or {} with a warning in ``log``: a chart must not fail the step it describes."""
    try:
        return chain_chart_metadata(instance, chain, upto, current)
    except Exception as error:
        log.warning(f"iterations_chart not drawn: {type(error).__name__}: {error}")
        return {}


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
        self._drawn = drawn_or_logged(self._log, *self._args)

    def __enter__(self) -> "ChainChart":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join()

    def metadata(self) -> dict[str, dg.MetadataValue]:
        return self._drawn
