"""The training window over drops that re-send history: exactly the distinct pairs of the drops it covers,
the earliest drop's row winning, new rows of later drops never lost (issue 47, item 1)."""
from __future__ import annotations

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.ingest.window import combine_drops
from batchrl.resources import LandingResource


def _pair(i: int) -> dict:
    return {"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"}


def _write_drop(folder, lines: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(lines), folder / "preferences.parquet")


def test_combine_keeps_new_rows_of_a_drop_that_resends_history(tmp_path):
    """Drop 2 = drop 1's 50 pairs + 3 new; drop 3 = 2 old + 2 new. Before the fix the window took rows by
    the rank of their group (lines 1-3 of drop 2, never 51-53)."""
    _write_drop(tmp_path / "d1", [_pair(i) for i in range(50)])
    _write_drop(tmp_path / "d2", [_pair(i) for i in range(53)])
    _write_drop(tmp_path / "d3", [_pair(0), _pair(51), _pair(60), _pair(61)])
    drops = [("d1", str(tmp_path / "d1")), ("d2", str(tmp_path / "d2")), ("d3", str(tmp_path / "d3"))]
    report = combine_drops(drops, str(tmp_path / "out"))
    table = pq.read_table(tmp_path / "out" / "preferences.parquet").to_pylist()
    expected = [(_pair(i)["prompt"], d) for i, d in
                [*((i, "d1") for i in range(50)), (50, "d2"), (51, "d2"), (52, "d2"), (60, "d3"), (61, "d3")]]
    assert [(r["prompt"], r["drop"]) for r in table] == expected  # distinct, in landing order, earliest wins
    assert report["rows_in"] == 107 and report["rows"] == 55 and report["cross_drop_duplicates"] == 52
    assert report["rows_taken_per_drop"] == {"d1": 50, "d2": 3, "d3": 2}
    assert report["cross_drop_duplicates_per_drop"] == {"d1": 0, "d2": 50, "d3": 2}


def test_a_pair_differing_in_one_field_is_not_a_duplicate(tmp_path):
    _write_drop(tmp_path / "a", [_pair(1)])
    _write_drop(tmp_path / "b", [{**_pair(1), "rejected": "something else"}, _pair(1)])
    report = combine_drops([("a", str(tmp_path / "a")), ("b", str(tmp_path / "b"))], str(tmp_path / "out"))
    assert report["rows"] == 2 and report["rows_taken_per_drop"] == {"a": 1, "b": 1}


def test_window_through_dagster_holds_the_new_drops_rows(tmp_path):
    """The issue's reproduction, through the real assets: ingest drop 1, then drop 2 (history + 3 new)."""
    prefs = tmp_path / "landing" / "preferences"
    prefs.mkdir(parents=True)

    def land(name, pairs):
        (prefs / name).write_text("".join(json.dumps(p) + "\n" for p in pairs))

    land("drop_1.jsonl", [_pair(i) for i in range(50)])
    resources = local_resources(str(tmp_path / "s"), LandingResource(preferences=str(prefs)))
    data = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window"]
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_assets(resources, instance, data).success
        land("drop_2.jsonl", [_pair(i) for i in range(53)])
        assert run_assets(resources, instance, data).success
        window = latest_metadata(instance, "preference_window")
        assert window["drops"] == ["drop_1.jsonl", "drop_2.jsonl"] and window["rows"] == 53
        assert window["rows_taken_per_drop"] == {"drop_1.jsonl": 50, "drop_2.jsonl": 3}
        assert window["cross_drop_duplicates_per_drop"] == {"drop_1.jsonl": 0, "drop_2.jsonl": 50}
