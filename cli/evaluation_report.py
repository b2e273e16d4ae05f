"""The end of `batchrl run`'s summary: the evaluation report as a table of metrics by model, and what the embedded
default's numbers mean."""
from __future__ import annotations

import os

# the evaluated models' column headings: a terminal of 100 columns holds the table with five models
SHORT_MODEL_NAMES = {"base_model": "base", "policy_checkpoint": "policy", "dpo_checkpoint": "dpo",
                     "offline_policy_checkpoint": "offline", "kto_checkpoint": "kto"}
TABLE_WIDTH = 100  # as the run's lines (console.CONSOLE_WIDTH)


def evaluation_table(report: dict, width: int = TABLE_WIDTH) -> list[str]:
    """One row per numeric metric, one column per model (the comparison the UI shows), ``width`` columns at most
    (a metric name too long for what the models leave is cut with an ellipsis)."""
    models = list(report)
    headings = [SHORT_MODEL_NAMES.get(m, m) for m in models]
    metrics = sorted({m for r in report.values() for m, v in r.items() if isinstance(v, (int, float))})
    cell = max([len(h) for h in headings] + [10])  # format_value gives 10 characters at most (-1.234e-05)
    name_width = max(6, min(max([len(m) for m in metrics] + [6]), width - len(models) * (cell + 2)))
    name = lambda text: text if len(text) <= name_width else text[:name_width - 1] + "…"  # noqa: E731
    lines = [f"{'metric':<{name_width}}" + "".join(f"  {h:>{cell}}" for h in headings)]
    for metric in metrics:
        cells = [report[m].get(metric) for m in models]
        lines.append(f"{name(metric):<{name_width}}" +
                     "".join(f"  {'' if v is None else format_value(round(v, 4)):>{cell}}" for v in cells))
    return lines


def tiny_default_config(base_model_dir) -> dict | None:
    """The base model's recorded config when it was the tiny default (no model path, no GGUF), else None."""
    import json

    path = os.path.join(base_model_dir or "", "lineage.json")
    if not base_model_dir or not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f).get("config") or {}
    if config.get("model_path") or config.get("gguf_file") or config.get("gguf_parts"):
        return None
    return config


def tiny_default_note(config: dict) -> str:
    """What the evaluation table of a tiny default base model shows: a habit the warm start taught and RL unlearns
    (a gold share below 1), else a random model that shows the pipeline only."""
    share = config.get("warm_start_gold_share")
    if config.get("warm_start_steps") and share is not None and share < 1:
        offset = config.get("warm_start_near_miss_offset", 1)
        return (f"  (the embedded default: a ~2.7M-parameter model built offline, warm-started to answer gold "
                f"{offset:+d},\n   the sum only {share:.0%} of the time: RL unlearns that habit, a demo of the loop "
                "(docs/GRAPH.md);\n   `batchrl run --profile real` trains SmolLM2-135M-Instruct)\n")
    return ("  (the embedded default is a random ~2.7M-parameter model built offline: it shows the pipeline, "
            "not learning;\n   `batchrl run --profile real` trains SmolLM2-135M-Instruct, 22.5% -> 54% "
            "held-out on one H200)\n")


def format_value(value) -> str:
    """A metric as the console shows it: 4 significant digits, thousands separated from 10,000."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and value >= 10_000:
        return f"{value:,}"
    return str(value)
