"""Issue 47, the data plane's items: 1-5 ratings mapped to thumbs by ``label_values`` (4), a mapped field outside
the contract kept in ``extra`` so logged log-probs reach offline GRPO's importance weights (8), a configurable
duplicate key that does not merge rows differing in a logged value (10), and reason codes that say what is wrong
with a row (11). Each test fails on the code before the fix."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import ValidationError

from batchrl.ingest import IngestConfig, discover_inputs, ingest_logs
from batchrl.ingest.config import REASONS, FeedbackLogsConfig, PreferenceDropConfig, ScoredLogsConfig


def _write(folder, name: str, records: list) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if name.endswith(".parquet"):  # every record's keys as columns (from_pylist takes the first record's)
        names = list(dict.fromkeys(k for r in records for k in r))
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in names} for r in records]), path)
    else:
        with open(path, "w") as f:
            f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    return str(folder)


def _ingest(folder, out, cfg):
    _, report = ingest_logs(discover_inputs(str(folder)), str(out), cfg, keep_cleaned=False)
    assert report.invariant_holds  # rows_in == valid + quarantined + duplicates
    name = {"preference": "preferences", "scored": "scored", "feedback": "feedback"}[cfg.kind]
    return report, pq.read_table(report.outputs[name]).to_pylist(), pq.read_table(report.outputs["quarantine"]).to_pylist()


# -- 4. label_values ---------------------------------------------------------------------------------------------
RATINGS = [1, 2, 3, 4, 5, "5", 5.0, "1", " 4 "]


@pytest.mark.parametrize("mapping_yaml", ["{1: false, 2: false, 4: true, 5: true}",
                                          "{'1': false, '2': false, '4': true, '5': true}"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_label_values_map_ratings_to_thumbs_whatever_the_key_or_label_type(tmp_path, mapping_yaml, fmt):
    """int or string keys (as YAML gives them) match labels logged as 5, "5" or 5.0; the user's 1 -> false wins
    over the built-in 1 -> true; a rating left unmapped (3) is quarantined as unknown_label."""
    config = yaml.safe_load(f"label_values: {mapping_yaml}")
    cfg = FeedbackLogsConfig(**config)
    ratings = RATINGS if fmt == "jsonl" else [1, 2, 3, 4, 5, 5, 1, 4]  # a Parquet column has one type
    rows = [{"prompt": f"q{i}", "completion": f"a{i}", "label": r} for i, r in enumerate(ratings)]
    report, valid, quarantine = _ingest(_write(tmp_path / "in", f"thumbs.{fmt}", rows), tmp_path / "out", cfg)
    expected = {f"a{i}": int(float(r)) >= 4 for i, r in enumerate(ratings) if int(float(r)) != 3}
    assert {row["completion"]: row["label"] for row in valid} == expected
    assert report.reasons == {"unknown_label": 1} and quarantine[0]["source_line"] == 3


def test_label_values_win_for_bool_and_text_labels(tmp_path):
    """An export whose true means 'flagged' inverts the thumbs: {true: false, false: true} applies to bools and to
    the text 'True'; text keys are case-insensitive."""
    cfg = FeedbackLogsConfig(**yaml.safe_load("label_values: {true: false, false: true, Meh: false}"))
    rows = [{"prompt": "q", "completion": f"a{i}", "label": v} for i, v in enumerate([True, False, "True", "meh"])]
    _, valid, _ = _ingest(_write(tmp_path / "in", "t.jsonl", rows), tmp_path / "out", cfg)
    assert [row["label"] for row in valid] == [False, True, False, False]


def test_label_values_keys_are_checked_when_written_and_int_keys_pass_the_run_config():
    import dagster as dg

    from batchrl.assets.data import FeedbackLogsRunConfig

    assert FeedbackLogsConfig(label_values={5: True, "1": False, 2.0: False}).label_values == \
        {"5": True, "1": False, "2": False}
    with pytest.raises(ValidationError, match="keys 5 and '5.0' are the same label '5' with different values"):
        FeedbackLogsConfig(label_values={5: True, "5.0": False})
    @dg.asset(config_schema=FeedbackLogsRunConfig.to_config_schema())
    def feedback() -> None: ...

    job = dg.Definitions(assets=[feedback]).resolve_implicit_global_asset_job_def()
    resolved = dg.validate_run_config(job, {"ops": {"feedback": {"config": {"label_values": {1: False, 5: True}}}}})
    assert FeedbackLogsConfig(**resolved["ops"]["feedback"]["config"]).label_values == {"1": False, "5": True}


# -- 8. mapped fields outside the contract ---------------------------------------------------------------------
def _logged(i: int, logprobs, **more) -> dict:
    return {"prompt": f"What is {i} + {i}?", "response": str(2 * i), "score": float(i % 2), "token_logprobs": logprobs,
            "temp": 0.7, **more}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("policy", ["keep", "drop", "quarantine"])
def test_a_mapped_field_outside_the_contract_lands_in_extra_under_its_new_name(tmp_path, fmt, policy):
    """field_mapping {token_logprobs: logprobs} keeps the values in extra as 'logprobs', whatever extra_fields
    says about unmapped fields (the mapping asks for them); an unmapped field follows extra_fields."""
    cfg = ScoredLogsConfig(field_mapping={"token_logprobs": "logprobs", "temp": "temperature"}, extra_fields=policy)
    rows = [_logged(i, [-0.5, -0.25]) for i in range(3)] + [_logged(3, [-1.0], model="m1")]
    report, valid, quarantine = _ingest(_write(tmp_path / "in", f"logs.{fmt}", rows), tmp_path / "out", cfg)
    extras = [json.loads(row["extra"]) for row in valid]
    assert [e["logprobs"] for e in extras] == [[-0.5, -0.25]] * 3 + [[-1.0]][:len(extras) - 3]
    assert all(e["temperature"] == 0.7 and "token_logprobs" not in e and "temp" not in e for e in extras)
    if policy == "keep":
        assert extras[3]["model"] == "m1"
    elif policy == "drop":
        assert len(extras) == 4 and "model" not in extras[3]
    else:
        assert len(valid) == 3 and [q["reason"] for q in quarantine] == ["extra_field"]


def test_logged_logprobs_mapped_by_config_reach_offline_grpo_importance_weights(tmp_path, arith_model):
    """End to end: logged completions whose per-token log-probs sit in a field of another name ('token_logprobs'),
    mapped by the scored logs' config (YAML), are ingested and weight offline GRPO's loss: log-probs far below the
    model's make every truncated importance weight the threshold."""
    from batchrl.training.jobs._runtime import Reporter
    from batchrl.training.jobs.train_policy import work
    from batchrl.training.rl.offline_policy import OfflinePolicyConfig, has_logged_logprobs
    from batchrl.training.models.loading import load_tokenizer

    tok = load_tokenizer(arith_model)
    rows = []
    for a in range(1, 5):
        for response, score in ((str(2 * a), 1.0), (str(2 * a + 1), 0.0)):
            tokens = len(tok(response, add_special_tokens=False)["input_ids"]) + 1  # + end of sequence
            rows.append({"prompt": f"What is {a} + {a}?", "response": response, "score": score,
                         "token_logprobs": [-50.0] * tokens})
    cfg = ScoredLogsConfig(**yaml.safe_load("field_mapping: {token_logprobs: logprobs}"))
    report, valid, _ = _ingest(_write(tmp_path / "landing", "logs.jsonl", rows), tmp_path / "scored", cfg)
    scored = report.outputs["scored"]
    assert report.valid == len(rows) and has_logged_logprobs(pq.read_table(scored), "logprobs")

    offline = OfflinePolicyConfig(objective="grpo", importance_weights=True, micro_batch_size=8, ppo_epochs=1,
                                  kl_loss_coef=0.0)
    config = {"trainer": offline.trainer_fields(), "model_path": arith_model, "out_dir": str(tmp_path / "out"),
              "logged": {"scored_parquet": scored, "offline": offline.model_dump()}}
    result, model_dir = work(config, Reporter(None))
    assert result["logged_samples"] == len(rows) and model_dir
    assert result["final"]["rollout_is_weight_mean"] == pytest.approx(offline.rollout_is_threshold)


# -- 10. the duplicate key ---------------------------------------------------------------------------------------
def test_logged_completions_that_differ_in_a_logged_value_are_not_merged(tmp_path):
    """Same prompt, completion and score from two sampling runs with other log-probs: both kept by default; an exact
    copy is a duplicate; dedupe_key [prompt, response] merges the runs (and rows that differ only in score)."""
    mapping = {"field_mapping": {"token_logprobs": "logprobs"}}
    rows = [_logged(1, [-0.5]), _logged(1, [-0.7]), _logged(1, [-0.5]), _logged(1, [-0.5], score=0.5),
            _logged(2, [-0.1])]
    folder = _write(tmp_path / "in", "logs.jsonl", rows)
    report, valid, quarantine = _ingest(folder, tmp_path / "default", ScoredLogsConfig(**mapping))
    assert (report.valid, report.duplicates) == (4, 1)
    assert [q["source_line"] for q in quarantine if q["reason"] == "duplicate"] == [3]
    assert len({row["id"] for row in valid}) == 4  # rows kept apart never share a content id
    keyed = ScoredLogsConfig(**mapping, dedupe_key=["prompt", "response"])
    report, valid, _ = _ingest(folder, tmp_path / "keyed", keyed)
    assert (report.valid, report.duplicates) == (2, 3) and [row["source_line"] for row in valid] == [1, 5]


def test_dedupe_key_is_documented_and_checked_when_written():
    from batchrl.assets.common import field_description
    from batchrl.assets.data import ScoredLogsRunConfig

    assert "log-probs" in field_description(ScoredLogsConfig, "dedupe_key")
    assert "dedupe_key" in ScoredLogsRunConfig.model_fields
    with pytest.raises(ValidationError, match=r"dedupe_key \['prompt', 'completion'\]: \['completion'\] are not "
                                              "fields of scored rows"):
        ScoredLogsConfig(dedupe_key=["prompt", "completion"])
    for bad in ([], ["prompt", "prompt"]):
        with pytest.raises(ValidationError, match="dedupe_key"):
            PreferenceDropConfig(dedupe_key=bad)
    assert IngestConfig().duplicate_key == ("prompt", "chosen", "rejected", "prompt_messages", "extra")


# -- 11. reason codes ---------------------------------------------------------------------------------------------
def _hh(*turns) -> str:
    return "".join(f"\n\n{speaker}: {text}" for speaker, text in turns)


def test_reason_codes_say_what_is_wrong_with_the_row(tmp_path):
    ok = {"prompt": "p", "chosen": "a", "rejected": "b"}
    rows = [
        {"chosen": "Sure, here it is.", "rejected": "No."},                               # HH row without speaker tags
        {"chosen": _hh(("Human", "hi"), ("Assistant", "hello")), "rejected": _hh(("Human", "hi"), ("Assistant", "go"))},
        {**ok, "rejected": []},                                                           # empty rejected
        {"messages": "not a list", "chosen": "a", "rejected": "b"},
        {"messages": [], "chosen": "a", "rejected": "b"},
        {"messages": [{"speaker": "user", "text": "hi"}], "chosen": "a", "rejected": "b"},
        {**ok, "prompt": "p2"},
    ]
    report, valid, quarantine = _ingest(_write(tmp_path / "in", "drop.jsonl", rows), tmp_path / "out",
                                        PreferenceDropConfig())
    assert len(valid) == 2 and report.rows_in == len(rows) == report.valid + report.quarantined + report.duplicates
    by_line = {q["source_line"]: q for q in quarantine}
    assert {line: q["reason"] for line, q in by_line.items()} == {
        1: "unparsable_transcript", 3: "empty_field", 4: "wrong_type", 5: "empty_field", 6: "wrong_type"}
    assert "no turn markers" in by_line[1]["detail"] and "rejected is an empty list" == by_line[3]["detail"]
    assert "messages must be a list of {role, content} messages, got a str" == by_line[4]["detail"]
    assert "messages[0] is not a {role, content} message" in by_line[6]["detail"]
    assert not any("field_mapping" in q["detail"] for q in quarantine)
    for q in quarantine:  # every quarantined row keeps its reason, file, line and raw text
        assert q["reason"] in REASONS and q["source_file"] == "drop.jsonl"
        assert json.loads(q["raw"]) == rows[q["source_line"] - 1]


def test_an_empty_list_in_parquet_is_empty_not_nested(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": []}, {"prompt": "q", "chosen": "a", "rejected": ["x", "y"]}]
    _, _, quarantine = _ingest(_write(tmp_path / "in", "drop.parquet", rows), tmp_path / "out", PreferenceDropConfig())
    assert [(q["reason"], q["source_line"]) for q in quarantine] == [("empty_field", 1), ("nested_value", 2)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_hh_transcripts_without_speaker_tags_are_unparsable_in_any_format(tmp_path, fmt):
    """HH-RLHF pairs (chosen and rejected only), the first without tags: the file is read, that row is an
    unparsable transcript (not a file or a pair missing its prompt), the tagged one is valid."""
    rows = [{"chosen": "Sure, here it is.", "rejected": "No."},
            {"chosen": _hh(("Human", "hi"), ("Assistant", "hello")), "rejected": _hh(("Human", "hi"), ("Assistant", "go"))}]
    report, valid, quarantine = _ingest(_write(tmp_path / "in", f"hh.{fmt}", rows), tmp_path / "out",
                                        PreferenceDropConfig())
    assert [(row["prompt"], row["chosen"]) for row in valid] == [("hi", "hello")]
    assert [(q["reason"], q["source_line"]) for q in quarantine] == [("unparsable_transcript", 1)]


def test_a_columnar_file_with_another_prompt_name_is_still_a_file_error(tmp_path):
    """Letting chosen/rejected-only files through to the transcript check keeps the early error of a file whose
    prompt column has another name (the mapping is missing)."""
    from batchrl.ingest.faults import BadInputFiles

    rows = [{"question": "q", "chosen": "a", "rejected": "b"}]
    with pytest.raises(BadInputFiles, match=r"missing fields \['prompt'\]; extra fields \['question'\]"):
        _ingest(_write(tmp_path / "in", "d.parquet", rows), tmp_path / "out", PreferenceDropConfig())
