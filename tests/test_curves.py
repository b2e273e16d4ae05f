"""The curve builder: a training job's step records in, a PNG chart (panel per metric family) and a table out;
the evaluation's grouped bars; bad step files named by file and line."""
from __future__ import annotations

import base64
import json

import pytest

from batchrl.assets.charts import COLUMNS, DPI, PANEL_INCHES, grouped_bars, line_panels, png_size
from batchrl.assets.curves import curve_metadata, curve_table, panels, read_steps, step_series
from batchrl.training.jobs._runtime import STEPS_FILE


def _records(n: int) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "rewards/chosen": 0.1 * s, "rewards/rejected": -0.1 * s,
             "rewards/margins": 0.2 * s, "grad_norm": 1.0, "lr": 1e-3, "ppo_kl": "nan" if s == 2 else 0.01 * s,
             "epoch": 0.0} for s in range(1, n + 1)]


def _expected_size(n_panels: int) -> tuple[int, int]:
    columns = min(COLUMNS, n_panels)
    rows = -(-n_panels // columns)
    return int(PANEL_INCHES[0] * columns * DPI), int(PANEL_INCHES[1] * rows * DPI)  # Agg truncates


def test_step_records_become_one_panel_per_metric_family_in_a_png_of_the_grid_size():
    series = step_series(_records(30), {"critic_value_loss_curve": [0.5, 0.4, 0.3]})
    assert "epoch" not in series and "step" not in series
    assert series["ppo_kl"][0][:3] == [1, 2, 3] and series["ppo_kl"][1][1] != series["ppo_kl"][1][1]  # nan kept
    assert series["critic_value_loss_curve"] == ([1, 2, 3], [0.5, 0.4, 0.3])
    chart = line_panels(panels(series))
    # the three rewards/* series share a panel; loss, grad_norm, lr, ppo_kl and the critic's curve have one each
    assert chart.panels == {"loss": 1, "rewards": 3, "grad_norm": 1, "lr": 1, "ppo_kl": 1, "critic_value_loss_curve": 1}
    assert png_size(chart.png) == chart.size == _expected_size(6) == (648, 273)
    assert line_panels({"loss": {"loss": series["loss"]}}).size == _expected_size(1)


def test_a_series_without_a_finite_value_is_left_out_and_nothing_to_draw_is_an_error():
    chart = line_panels({"a": {"a": ([1, 2], [1.0, 2.0])}, "b": {"b": ([1, 2], [float("nan")] * 2)}})
    assert chart.panels == {"a": 1}
    with pytest.raises(ValueError, match="no series"):
        line_panels({"b": {"b": ([1], [float("inf")])}})
    assert curve_metadata({"b": ([1], [float("nan")])}) == {}


def test_curve_metadata_embeds_the_png_above_the_table():
    text = curve_metadata(step_series(_records(5)))["curves"].value
    image, table = text.split("\n\n", 1)
    assert image.startswith("![per-step curves](data:image/png;base64,")
    assert png_size(base64.b64decode(image[image.index(",") + 1:-1]))[0] == 648
    assert table.splitlines()[0].startswith("| step | loss | rewards/chosen |")


def test_curve_table_keeps_the_last_step_and_bounds_rows():
    table = curve_table({"loss": (list(range(1, 101)), [float(i) for i in range(100)])}, max_rows=10).splitlines()
    assert table[0] == "| step | loss |" and len(table) <= 2 + 11
    assert table[-1] == "| 100 | 99 |" and table[2] == "| 1 | 0 |"


def test_read_steps_keeps_the_last_record_of_a_repeated_step_and_names_a_bad_line(tmp_path):
    lines = [{"step": 1, "loss": 0.9}, {"step": 2, "loss": 0.8}, {"step": 2, "loss": 0.7}, {"step": 3, "loss": 0.6}]
    (tmp_path / STEPS_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["loss"] for r in read_steps(str(tmp_path))] == [0.9, 0.7, 0.6]
    assert read_steps(str(tmp_path / "absent")) == []
    (tmp_path / STEPS_FILE).write_text('{"step": 1, "loss": 0.9}\n{"loss": 0.8}\n')
    with pytest.raises(ValueError, match=f"{STEPS_FILE}:2: not a step record"):
        read_steps(str(tmp_path))


def test_grouped_bars_draw_a_bar_per_model_in_each_group():
    chart = grouped_bars({
        "accuracy": {"all": {"base": 0.1, "dpo": 0.3, "policy": 0.4}, "arith": {"base": 0.2, "dpo": 0.3, "policy": 0.5}},
        "rm_mean_score": {"all": {"base": -1.0, "policy": 0.5}}})
    assert chart.panels == {"accuracy": 3, "rm_mean_score": 2}
    assert chart.size == _expected_size(2)


def test_a_chart_drawn_on_a_kept_figure_is_the_chart_a_new_figure_draws():
    """The RL loop redraws the same panels every iteration on the figure kept from the last time (half a render):
    the PNG is byte for byte the one a new figure gives, for other points, scales and a missing value."""
    import threading

    from batchrl.assets import charts

    def chart(seed: int, n: int) -> dict:
        import random

        rng = random.Random(seed)
        return panels({name: (list(range(1, n + 1)), [rng.random() * 10 ** rng.randint(-5, 3) for _ in range(n)])
                       for name in ("pg_loss", "ppo_kl", "lr", "rewards/chosen", "rewards/rejected")})

    charts._kept.clear()
    line_panels(chart(0, 24))
    later = chart(1, 30)
    later["ppo_kl"]["ppo_kl"][1][4] = float("nan")
    reused = line_panels(later).png
    assert len(charts._kept) == 1  # the same panels and series: the kept figure drew it
    charts._kept.clear()
    assert reused == line_panels(later).png
    few = chart(2, 5)  # markers on each point: another figure, kept beside the first
    assert line_panels(few).png != reused and len(charts._kept) == 2
    # threads drawing the same panels at once: each gets its own chart, right
    expected = {seed: line_panels(chart(seed, 24)).png for seed in range(3, 7)}
    got: dict[int, bytes] = {}
    threads = [threading.Thread(target=lambda s=seed: got.__setitem__(s, line_panels(chart(s, 24)).png))
               for seed in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected
