"""Every log shape of the held-out corpus (``log_shapes.py``) reaches a validated table through config alone:
every row mapped or quarantined with a reason, none lost; the same through the Dagster data assets; the
same logs at two landing paths give the same data versions; verl prompt sets refuse an unknown data_source."""
from __future__ import annotations

import json
import os
import shutil

import dagster as dg
import pyarrow.parquet as pq
import pytest
from log_shapes import ASSET, LANDING, TABLE, Shape, corpus, jsonl, write_shape
from pipeline_helpers import latest_metadata, local_resources, run_assets

from batchrl.ingest import REASONS, IngestConfig, discover_inputs, ingest_logs
from batchrl.resources import LandingResource
from batchrl.schemas import PANDERA_SCHEMAS, to_pandas

CORPUS = corpus()
DATA = ["raw_logs", "cleaned_logs", "validated_preferences"]


def test_the_corpus_covers_the_common_shapes():
    assert len(CORPUS) >= 12 and len({s.name for s in CORPUS}) == len(CORPUS)
    routes = {s.route for s in CORPUS}
    assert routes == {"flat", "message_lists", "conversation", "hh_transcript"}
    assert {s.kind for s in CORPUS} == {"preference", "scored", "feedback"}
    assert all(s.reasons and s.valid for s in CORPUS)  # each shape has good rows and malformed variants


def _check_outcome(shape: Shape, report, table_path: str, quarantine_path: str) -> None:
    assert report.rows_in == shape.rows, shape.name
    assert report.invariant_holds, shape.name  # rows_in == valid + quarantined + duplicates
    reasons = {k: v for k, v in report.reasons.items() if k != "duplicate"}
    assert (report.valid, reasons, report.duplicates) == (shape.valid, shape.reasons, shape.duplicates), shape.name
    assert set(reasons) <= set(REASONS)
    quarantine = pq.read_table(quarantine_path).to_pylist()
    assert len(quarantine) == report.quarantined + report.duplicates
    assert all(q["detail"] and q["source_file"] == shape.filename for q in quarantine), quarantine
    assert all(q["source_line"] >= 1 for q in quarantine)
    table = pq.read_table(table_path)
    PANDERA_SCHEMAS[shape.kind].validate(to_pandas(table))  # the published rows meet the contract
    assert set(table.column("source_file").to_pylist()) == {shape.filename}  # relative to the landing
    messages = [m for m in table.column("prompt_messages").to_pylist() if m is not None]
    if shape.extra.get("prompt_messages"):  # multi-turn context kept for the chat template
        assert len(messages) == shape.valid and all(json.loads(m)[-1]["role"] != "assistant" or len(json.loads(m)) > 1
                                                    for m in messages)
    else:
        assert not messages


@pytest.mark.parametrize("shape", CORPUS, ids=lambda s: s.name)
def test_every_row_is_mapped_or_quarantined_with_a_reason(shape, tmp_path):
    folder = write_shape(shape, str(tmp_path / "landing"))
    cfg = IngestConfig(kind=shape.kind, **shape.config)
    _, report = ingest_logs(discover_inputs(folder), str(tmp_path / "out"), cfg, keep_cleaned=False)
    _check_outcome(shape, report, report.outputs[TABLE[shape.kind].removesuffix(".parquet")],
                   report.outputs["quarantine"])
    mapped = report.extra["mapped"]  # how each structured row was mapped
    assert set(mapped) == {shape.route} and mapped[shape.route] >= shape.valid, mapped


def test_a_shape_is_one_line_of_config():
    """Each config above is plain data, as in a profile or -c file; wrong combinations fail when written."""
    from pydantic import ValidationError

    for shape in CORPUS:
        assert json.loads(json.dumps(shape.config)) == shape.config
    for bad in ({"kind": "scored", "transcript": {}}, {"kind": "preference", "label_values": {"meh": False}},
                {"kind": "feedback", "score_values": {"up": 1}}):
        with pytest.raises(ValidationError):
            IngestConfig(**bad)


def _run_shape(shape: Shape, landing_root: str, root: str, instance) -> dict:
    """Drop the shape's file into its landing folder and run the data assets of its kind through Dagster."""
    folder = write_shape(shape, landing_root)
    landing = LandingResource(**{LANDING[shape.kind]: folder})
    if shape.kind == "preference":
        ops = {"log_drop": {"config": {**shape.config, "reject_threshold": 0.6}}}
        selection = DATA + ["preference_window"]
    else:
        ops = {ASSET[shape.kind]: {"config": shape.config}}
        selection = ["scored_logs", "scored_pairs"] if shape.kind == "scored" else ["feedback_logs"]
    result = run_assets(local_resources(root, landing), instance, selection, {"ops": ops})
    assert result.success, shape.name
    return latest_metadata(instance, ASSET[shape.kind])


@pytest.mark.parametrize("shape", CORPUS, ids=lambda s: s.name)
def test_each_shape_through_the_dagster_data_assets(shape, tmp_path):
    with dg.DagsterInstance.ephemeral() as instance:
        meta = _run_shape(shape, str(tmp_path / "landing"), str(tmp_path / "s"), instance)
        assert (meta["valid"], meta["duplicates"]) == (shape.valid, shape.duplicates), meta
        assert meta["rows_in"] == meta["valid"] + meta["quarantined"] + meta["duplicates"] == shape.rows
        if shape.kind == "preference":
            assert latest_metadata(instance, "preference_window")["rows"] == shape.valid
            assert set(meta["stage"]["extra"]["mapped"]) == {shape.route}
        else:
            assert set(meta["mapped"]) == {shape.route}
        if shape.kind == "scored":  # ratings become preference pairs for DPO / the reward model
            assert latest_metadata(instance, "scored_pairs")["valid"] >= 1


def test_hh_transcripts_are_recognised_without_config(tmp_path):
    hh = next(s for s in CORPUS if s.name == "hh_rlhf")
    folder = write_shape(hh, str(tmp_path / "landing"))
    _, report = ingest_logs(discover_inputs(folder), str(tmp_path / "out"), IngestConfig(kind="preference"),
                            keep_cleaned=False)
    assert report.valid == hh.valid and report.extra["mapped"] == {"hh_transcript": hh.valid + 1}
    # the row with text before its first marker does not open as a transcript, but a record of chosen and
    # rejected alone is read as one: an unparsable transcript, as with `transcript: {}` (issue 47, not a
    # pair that lacks its prompt)
    assert report.reasons == hh.reasons


def test_scored_pairs_honour_pair_min_margin(tmp_path):
    stars = next(s for s in CORPUS if s.name == "star_ratings")
    folder = write_shape(stars, str(tmp_path / "landing"))
    resources = local_resources(str(tmp_path / "s"), LandingResource(scored=folder))
    pairs = {}
    with dg.DagsterInstance.ephemeral() as instance:
        for margin in (0.0, 3.5):
            ops = {"scored_logs": {"config": stars.config}, "scored_pairs": {"config": {"pair_min_margin": margin}}}
            assert run_assets(resources, instance, ["scored_logs", "scored_pairs"], {"ops": ops}).success
            pairs[margin] = latest_metadata(instance, "scored_pairs")
    assert pairs[0.0]["valid"] == 2 and pairs[3.5]["valid"] == 1  # margins 3 and 4 (1-5 stars)
    assert pairs[3.5]["reasons"] == {"below_margin": 1}


def test_two_landing_copies_at_different_paths_give_equal_data_versions(tmp_path):
    shapes = [s for s in CORPUS if s.name in ("flat_pairs", "star_ratings", "thumbs_bool")]
    versions = []
    for copy in ("a", "somewhere/else/b"):
        landing_root = str(tmp_path / copy / "landing")
        for shape in shapes:
            write_shape(shape, landing_root)
        shutil.copy(os.path.join(LandingResource().preferences, "prefs_000.jsonl"),
                    os.path.join(landing_root, "preferences"))
        landing = LandingResource(**{v: os.path.join(landing_root, v) for v in LANDING.values()})
        with dg.DagsterInstance.ephemeral() as instance:
            ops = {"log_drop": {"config": {"reject_threshold": 0.6}}, "scored_logs": {"config": {
                "field_mapping": {"rating": "score"}}}}
            assert run_assets(local_resources(str(tmp_path / copy / "s"), landing), instance,
                              DATA + ["preference_window", "scored_logs", "scored_pairs", "feedback_logs"],
                              {"ops": ops}).success
            versions.append({a: latest_metadata(instance, a)["data_version"] for a in
                             DATA + ["preference_window", "scored_logs", "scored_pairs", "feedback_logs"]})
    assert versions[0] == versions[1]


def test_verl_prompt_set_refuses_an_unknown_data_source_when_validated(tmp_path):
    from batchrl.training.data.prompts import PromptFileError, load_prompts

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1 + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}},
            {"data_source": "my/unrouted_set", "prompt": [{"role": "user", "content": "2 + 2?"}],
             "reward_model": {"style": "rule", "ground_truth": "4"}}]
    path = tmp_path / "train.parquet"
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), path)
    mapping = {"reward_model.ground_truth": "answer"}
    assert len(load_prompts(str(path), mapping=mapping)) == 2  # no list of known sources: any is taken
    with pytest.raises(PromptFileError, match="row 2: unknown data_source 'my/unrouted_set'"):
        load_prompts(str(path), mapping=mapping, data_sources=["openai/gsm8k"])
    # through the graph: the rewards routing of the run names the known sources; the prompts step refuses
    ops = {"prompts": {"config": {"field_mapping": mapping}},
           "rewards": {"config": {"route_by": "data_source", "custom": {"gsm8k": "gsm8k_strict"},
                                  "routing": {"openai/gsm8k": {"gsm8k": 1.0}}}}}
    with dg.DagsterInstance.ephemeral() as instance:
        result = run_assets(local_resources(str(tmp_path / "s"), LandingResource(prompts=str(path))), instance,
                            ["prompts"], {"ops": ops})
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "unknown data_source 'my/unrouted_set'" in str(failure.event_specific_data.error)


def test_jsonl_helper_round_trips():
    assert jsonl({"a": 1}, b'{"b": 2}') == b'{"a": 1}\n{"b": 2}\n'
