"""Every shape of the held-out corpus (``log_shapes.py``) through the Dagster assets to a trained checkpoint, in
one run whose data mixes them, with config alone: the preference shapes land as drops of one window (one
log_drop config, the union of their mappings; HH transcripts recognised without config), the scored shapes in
the scored landing, the thumbs in the feedback landing. DPO trains on the logged and the scored pairs together
(``source: logged+scored``), KTO on the thumbs, the offline policy on the scored completions: each objective
takes the rows it can use, every valid row of every shape reaches a checkpoint, none is lost, and the pairs
keep their source for the evaluation's per-source report."""
from __future__ import annotations

import math

import dagster as dg
import pyarrow.parquet as pq
import pytest
from log_shapes import LANDING, corpus, write_shape
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.resources import LandingResource

SHAPES = {kind: [s for s in corpus() if s.kind == kind] for kind in LANDING}
SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
             "feedback_logs", "prompts", "base_model", "dpo_pairs", "reference_logprobs", "dpo_checkpoint", "kto_checkpoint",
             "offline_policy_checkpoint"]


def _union_config(shapes) -> dict:
    """One config for several shapes: their mappings side by side (a mapped field a file lacks is not read)."""
    config: dict = {}
    for shape in shapes:
        for key, value in shape.config.items():
            if key == "transcript":
                continue  # recognised without config
            config.setdefault(key, {}).update(value)
    return config


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed")
    landing_root = str(tmp / "landing")
    for shapes in SHAPES.values():
        for shape in shapes:
            write_shape(shape, landing_root)
    landing = LandingResource(**{v: f"{landing_root}/{v}" for v in LANDING.values()})
    ops = {
        "log_drop": {"config": {**_union_config(SHAPES["preference"]), "reject_threshold": 0.6}},
        "scored_logs": {"config": _union_config(SHAPES["scored"])},
        "feedback_logs": {"config": _union_config(SHAPES["feedback"])},
        "base_model": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
        "dpo_pairs": {"config": {"source": "logged+scored"}},
        "dpo_checkpoint": {"config": {"epochs": 1}},
        "kto_checkpoint": {"config": {"epochs": 1}},
    }
    (tmp / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp / "home")) as instance:
        result = run_assets(local_resources(str(tmp / "storage"), landing), instance, SELECTION, {"ops": ops})
        assert result.success
        yield {asset: latest_metadata(instance, asset) for asset in SELECTION if asset not in ("raw_logs", "prompts",
                                                                                           "cleaned_logs")}


def test_every_preference_shape_is_a_drop_of_one_window(mixed):
    window = mixed["preference_window"]
    assert window["rows_per_drop"] == {s.filename: s.valid for s in SHAPES["preference"]}
    assert window["rows"] == sum(s.valid for s in SHAPES["preference"])


@pytest.mark.parametrize("kind", ["scored", "feedback"])
def test_every_row_of_the_other_shapes_is_validated_or_quarantined(mixed, kind):
    meta = mixed[{"scored": "scored_logs", "feedback": "feedback_logs"}[kind]]
    shapes = SHAPES[kind]
    assert meta["rows_in"] == sum(s.rows for s in shapes) == meta["valid"] + meta["quarantined"] + meta["duplicates"]
    assert meta["valid"] == sum(s.valid for s in shapes)
    assert set(meta["mapped"]) == {s.route for s in shapes}


def test_dpo_trains_on_the_logged_and_the_scored_pairs_each_with_its_source(mixed):
    pairs = mixed["dpo_pairs"]
    scored = pq.read_table(f"{mixed['scored_pairs']['uri']}/pairs.parquet").column("source_file").to_pylist()
    expected = {f"logged/{s.filename}": s.valid for s in SHAPES["preference"]}
    expected.update({f"scored/{f}": scored.count(f) for f in set(scored)})
    assert pairs["pairs_per_source"] == expected and pairs["pairs"] == sum(expected.values())
    assert len(set(scored)) >= 3  # ratings of several shapes became pairs
    dpo = mixed["dpo_checkpoint"]
    assert dpo["num_pairs"] == pairs["pairs"] and all(math.isfinite(x) for x in dpo["loss_curve"])


def test_kto_and_the_offline_policy_take_the_rows_they_can_use(mixed):
    kto = mixed["kto_checkpoint"]
    assert kto["num_examples"] == mixed["feedback_logs"]["valid"] and 0 < kto["num_desirable"] < kto["num_examples"]
    offline = mixed["offline_policy_checkpoint"]
    assert offline["logged_rows"] == offline["logged_samples"] == mixed["scored_logs"]["valid"]  # awr: every row
    assert all(math.isfinite(x) for x in offline["loss_curve"])
