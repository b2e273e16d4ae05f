"""What the evaluation shows in the UI: base / DPO / policy side by side in one chart (a panel per metric, its
categories and pair sources as groups), no key twice, model output with its control characters escaped."""
from __future__ import annotations

import dagster as dg

from batchrl.assets.charts import png_size
from batchrl.assets.evaluation import _examples_markdown, overlay_panels, without_single_group_copies

MODELS = ("base_model", "policy_checkpoint", "dpo_checkpoint")


def _results(one_category: bool) -> dict:
    results = {}
    for i, model in enumerate(MODELS):
        accuracy = 0.1 * (i + 1)
        metrics = {"arith_n": 50, "arith_accuracy": accuracy, "accuracy/arith": accuracy, "n/arith": 50,
                   "arith_stop_rate": 0.5, "preference_n": 246, "preference_accuracy": 0.2 + i / 10,
                   "preference_accuracy/logged/a.jsonl": 0.16, "preference_n/logged/a.jsonl": 125,
                   "preference_accuracy/logged/b.jsonl": 0.21, "preference_n/logged/b.jsonl": 121,
                   "rm_mean_score": -1.0 + i, "examples": []}
        if not one_category:
            metrics.update({"accuracy/arith": accuracy * 2, "accuracy/gsm8k": 0.0, "n/arith": 25, "n/gsm8k": 25})
        results[model] = metrics
    return results


def test_a_category_breakdown_of_one_category_is_not_shown_twice():
    shown = without_single_group_copies(_results(one_category=True)["base_model"])
    assert "accuracy/arith" not in shown and "n/arith" not in shown and shown["arith_accuracy"] == 0.1
    assert "preference_accuracy/logged/a.jsonl" in shown  # two sources: a breakdown, kept
    two = without_single_group_copies(_results(one_category=False)["base_model"])
    assert {"accuracy/arith", "accuracy/gsm8k", "n/arith", "n/gsm8k"} <= set(two)


def test_overlay_puts_every_model_in_each_metric_panel_grouped_by_category_and_source():
    results = _results(one_category=False)
    results["policy_checkpoint"].update({"arith_accuracy_stderr": 0.01, "arith_gain": 0.05, "arith_gain_stderr": 0.01,
                                         "arith_gain_ci95_low": 0.03, "arith_gain_ci95_high": 0.07,
                                         "arith_gain_questions_won": 9, "arith_gain_questions_lost": 4})
    panels = overlay_panels(results)
    # no counts, and of a gain the gain alone (its error, interval and question counts: the table's)
    assert set(panels) == {"accuracy", "arith_stop_rate", "preference_accuracy", "rm_mean_score", "arith_gain"}
    assert list(panels["accuracy"]) == ["all", "arith", "gsm8k"]
    assert panels["accuracy"]["all"] == {m: results[m]["arith_accuracy"] for m in MODELS}
    assert list(panels["preference_accuracy"]) == ["all", "logged/a.jsonl", "logged/b.jsonl"]
    assert panels.pop("arith_gain") == {"all": {"policy_checkpoint": 0.05}}  # only the models that have one
    assert all(list(group) == list(MODELS) for panel in panels.values() for group in panel.values())


def test_the_overlay_chart_draws_every_model_in_each_panel():
    """The chart as the asset publishes it: a PNG with a panel per metric, each drawing the three models."""
    from batchrl.assets.charts import grouped_bars

    chart = grouped_bars(overlay_panels({m: without_single_group_copies(r) for m, r in _results(True).items()}))
    assert chart.panels == {"accuracy": 3, "arith_stop_rate": 3, "preference_accuracy": 3, "rm_mean_score": 3}
    assert png_size(chart.png)[0] == 648 and isinstance(dg.MetadataValue.md(chart.markdown("x")), dg.MarkdownMetadataValue)


def test_control_characters_in_model_output_are_escaped_in_the_examples():
    results = {"policy_checkpoint": {"examples": [
        {"category": "arith", "prompt": "Compute 1 + 2.\x00", "response": "3\x07\x1b[0m |x", "answer": "3"}]}}
    row = _examples_markdown(results).splitlines()[-1]
    assert "\\x07" in row and "\\x1b" in row and "\\x00" in row
    assert not any(ord(c) < 32 for c in row) and row.count("|") == 6  # the response's pipe does not split a cell
