"""Per-step curves of every training asset: the metrics its job reported step by step (``steps.jsonl`` in the
job's work dir, ``training.jobs._runtime``) as one chart and a compact table in the materialisation, and as
(step, value) points for the experiment tracker."""
from __future__ import annotations

import json
import math
import os

import dagster as dg

from batchrl.assets.charts import line_panels
from batchrl.training.jobs._runtime import STEPS_FILE

NOT_CURVES = ("step", "epoch")  # the x-axis and the epoch counter: not series of their own
Series = dict[str, tuple[list[int], list[float]]]  # name -> (steps, values)


def read_steps(workdir: str) -> list[dict]:
    """The job's step records in step order, the last one of each step kept (a resumed job repeats the steps after
    its last checkpoint); [] when the job reported none. A line that is no JSON object with a step is an error
    naming the file and line."""
    path = os.path.join(workdir, STEPS_FILE)
    if not os.path.exists(path):
        return []
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                by_step[int(record["step"])] = record
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not a step record ({err}): {line[:120]!r}") from None
    return [by_step[step] for step in sorted(by_step)]


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # non-finite values travel as "nan" / "inf"
        try:
            return float(value)
        except ValueError:
            return None
    return None


def step_series(records: list[dict], lists: dict[str, list] | None = None) -> Series:
    """Each numeric metric of ``records`` as (steps, values), plus ``lists`` (a job's other per-step lists, e.g.
    the critic's ``critic_value_loss_curve``) numbered from step 1."""
    series: Series = {}
    for record in records:
        for name, value in record.items():
            number = _number(value)
            if name in NOT_CURVES or number is None:
                continue
            steps, values = series.setdefault(name, ([], []))
            steps.append(int(record["step"]))
            values.append(number)
    for name, values in (lists or {}).items():
        numbers = [_number(v) for v in values]
        if values and all(n is not None for n in numbers):
            series[name] = (list(range(1, len(values) + 1)), numbers)
    return series


def panels(series: Series) -> dict[str, Series]:
    """Series that share a prefix (``rewards/chosen``, ``rewards/rejected``) in one panel; each other alone."""
    grouped: dict[str, Series] = {}
    for name, xy in series.items():
        grouped.setdefault(name.split("/")[0] if "/" in name else name, {})[name] = xy
    return grouped


def curve_table(series: Series, max_rows: int = 20) -> str:
    """The series as a Markdown table at most ``max_rows`` evenly spaced steps, the last always included."""
    steps = sorted({s for xs, _ in series.values() for s in xs})
    stride = max(1, -(-len(steps) // max_rows))
    shown = sorted({*steps[::stride], steps[-1]})
    at = {name: dict(zip(xs, ys)) for name, (xs, ys) in series.items()}
    fmt = lambda v: "" if v is None else f"{v:.4g}"  # noqa: E731
    lines = ["| step | " + " | ".join(series) + " |", "|---:|" + "---:|" * len(series)]
    lines += [f"| {s} | " + " | ".join(fmt(at[name].get(s)) for name in series) + " |" for s in shown]
    return "\n".join(lines)


def curve_metadata(series: Series) -> dict[str, dg.MetadataValue]:
    """``curves``: the chart (a panel per metric family) above the table; {} without a finite point."""
    if not any(math.isfinite(v) for _, ys in series.values() for v in ys):
        return {}
    chart = line_panels(panels(series))
    return {"curves": dg.MetadataValue.md(f"{chart.markdown('per-step curves')}\n\n{curve_table(series)}")}
