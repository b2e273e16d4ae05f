"""Cleaning, reason codes, the row invariant, mappings, determinism and streaming of the data plane."""
from __future__ import annotations

import hashlib
import json
import os

import pyarrow.parquet as pq
import pytest

from batchrl.ingest import (
    REASONS, ChatMapping, IngestConfig, IngestError, StageReport, check_reject_rate, clean_logs, discover_inputs,
    validate_preferences, validate_scored,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "sample_data", "preferences")


def run(src, out, cfg=None):
    cfg = cfg or IngestConfig()
    cleaned = clean_logs(discover_inputs(str(src)), f"{out}/cleaned", cfg)
    valid = validate_preferences(f"{out}/cleaned", f"{out}/valid", cfg)
    return cleaned, valid


def write_jsonl(path, rows):
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode() + b"\n")
    return path


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    return out, *run(SAMPLE, out)


def test_sample_data_reason_codes_and_invariant(sample_run):
    out, cleaned, valid = sample_run
    # extra_fields=keep (default): the record that only has other names is missing the contract fields
    assert cleaned.reasons == {"invalid_json": 1, "missing_field": 2, "nested_value": 2,
                               "not_object": 1, "undecodable": 1, "wrong_type": 1}
    assert valid.reasons == {"chosen_equals_rejected": 1, "duplicate": 2, "empty_field": 2}
    for report in (cleaned, valid):
        assert report.invariant_holds and set(report.reasons) <= set(REASONS)
        assert check_reject_rate(report, 0.05)[0]  # the demo passes the default gate
        meta = report.to_metadata()
        assert json.loads(json.dumps(meta)) == meta
    assert (cleaned.rows_in, valid.rows_in, valid.valid, valid.duplicates) == (259, 251, 246, 2)
    quarantine = pq.read_table(cleaned.outputs["quarantine"]).to_pylist()
    assert all(q["source_file"].endswith(("prefs_000.jsonl", "prefs_001.jsonl")) and q["raw"] and q["detail"] for q in quarantine)
    undecodable = next(q for q in quarantine if q["reason"] == "undecodable")
    data = open(os.path.join(SAMPLE, "prefs_001.jsonl"), "rb").read()
    offset = int(undecodable["detail"].split("byte offset ")[1].split(" ")[0])
    assert data[offset] == 0xE9 and data[:offset].count(b"\n") + 1 == undecodable["source_line"]
    assert "\\xe9" in undecodable["raw"]
    other_names = next(q for q in quarantine if "best_response" in q["raw"])
    assert other_names["reason"] == "missing_field"
    assert "best_response" in other_names["detail"] and "field_mapping" in other_names["detail"]


def test_strict_extra_fields_keeps_the_old_contract(tmp_path):
    cleaned, _ = run(SAMPLE, tmp_path, IngestConfig(extra_fields="error"))
    assert cleaned.reasons == {"extra_field": 1, "invalid_json": 1, "missing_field": 1, "nested_value": 2,
                               "not_object": 1, "undecodable": 1, "wrong_type": 1}
    quarantine = pq.read_table(cleaned.outputs["quarantine"]).to_pylist()
    extra = next(q for q in quarantine if q["reason"] == "extra_field")
    assert "best_response" in extra["detail"] and "instruction" in extra["detail"]


def test_cleaning_bom_controls_nfc_trim(sample_run):
    _, cleaned, _ = sample_run
    rows = pq.read_table(cleaned.outputs["cleaned"]).to_pylist()
    by_prompt = {r["prompt"]: r for r in rows}
    assert rows[0]["prompt"].startswith("What is") and rows[0]["id"] == "pref-0000"  # file BOM stripped
    assert "What is 7 * 8?" in by_prompt  # BOM on a line mid-file
    assert "Say hi politely[0m" in by_prompt and "Raw control char in the prompt" in by_prompt
    assert "Trailing NUL removed" in by_prompt
    assert "Café or cafe? Spell café in NFC." in by_prompt  # combining accent composed (NFC)
    trimmed = by_prompt["What is 9 + 10?"]
    assert (trimmed["chosen"], trimmed["rejected"]) == ("9 + 10 = 19.", "9 + 10 = 21.")
    coding = next(r for r in rows if r["category"] == "coding")
    assert "\n    return" in coding["chosen"]  # newlines and indentation kept by default


def test_collapse_whitespace_option(tmp_path):
    src = write_jsonl(tmp_path / "w.jsonl", [{"prompt": "a \t\n  b", "chosen": "x  y", "rejected": "z"}])
    _, valid = run(src, tmp_path / "o1")
    assert pq.read_table(valid.outputs["preferences"]).column("prompt").to_pylist() == ["a \t\n  b"]
    _, valid = run(src, tmp_path / "o2", IngestConfig(collapse_whitespace=True))
    row = pq.read_table(valid.outputs["preferences"]).to_pylist()[0]
    assert (row["prompt"], row["chosen"]) == ("a b", "x y")


def test_first_record_without_contract_names_file_line_fields(tmp_path):
    src = write_jsonl(tmp_path / "alt.jsonl", [b"\n", {"instruction": "q", "best_response": "a",
                                                       "worst_response": "b"}])
    with pytest.raises(IngestError) as err:
        clean_logs(discover_inputs(str(src)), str(tmp_path / "o"), IngestConfig())
    msg = str(err.value)
    assert "alt.jsonl:2" in msg and "['prompt', 'chosen', 'rejected']" in msg
    assert "['best_response', 'instruction', 'worst_response']" in msg


def test_field_mapping_with_json_paths(tmp_path):
    rows = [{"instruction": f"q{i}", "best_response": "good", "worst_response": "bad",
             "meta": {"topic": "t", "ts": 1700000000 + i}} for i in range(3)]
    rows.append({"instruction": "q9", "best_response": "good", "worst_response": "bad", "oops": 1})
    src = write_jsonl(tmp_path / "alt.jsonl", rows)
    cfg = IngestConfig(field_mapping={"instruction": "prompt", "best_response": "chosen",
                                      "worst_response": "rejected", "meta.topic": "category",
                                      "meta.ts": "timestamp"})
    cleaned, valid = run(src, tmp_path / "o", cfg)
    got = pq.read_table(valid.outputs["preferences"]).to_pylist()
    assert [(r["prompt"], r["chosen"], r["category"], r["timestamp"]) for r in got][:1] == [
        ("q0", "good", "t", "1700000000")]
    assert cleaned.reasons == {} and valid.valid == 4  # extra_fields=keep
    assert [r["extra"] for r in got] == [None, None, None, '{"oops": 1}']
    assert cleaned.extra["extra_fields"] == {"oops": 1}


def test_flat_mapping_uses_fast_path_and_drop_fields(tmp_path):
    rows = [{"q": f"q{i}", "a": "good", "b": "bad", "debug": {"x": i}} for i in range(5)]
    src = write_jsonl(tmp_path / "m.jsonl", rows)
    cfg = IngestConfig(field_mapping={"q": "prompt", "a": "chosen", "b": "rejected"}, drop_fields=["debug"])
    cleaned, valid = run(src, tmp_path / "o", cfg)
    assert (cleaned.quarantined, valid.valid) == (0, 5)


def test_chat_mapping_nested_messages(tmp_path):
    conv = lambda answer: [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},  # noqa
                           {"role": "assistant", "content": answer}]
    rows = [{"chosen": conv("4"), "rejected": conv("5"), "category": "math"},
            {"prompt": [{"role": "user", "content": "Capital of France?"}],
             "chosen": [{"role": "assistant", "content": "Paris"}], "rejected": [{"role": "assistant", "content": "Rome"}]},
            {"chosen": [{"role": "user", "content": "hi"}], "rejected": conv("x")}]  # no assistant turn
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    for cfg in (IngestConfig(), IngestConfig(chat_mapping=ChatMapping())):  # message lists are recognised
        cleaned, valid = run(src, tmp_path / "o", cfg)
        got = pq.read_table(valid.outputs["preferences"]).to_pylist()
        assert [(r["prompt"], r["chosen"], r["rejected"]) for r in got] == [
            ("system: Be brief.\nuser: 2+2?", "4", "5"), ("Capital of France?", "Paris", "Rome")]
        assert [r["prompt_messages"] is not None for r in got] == [True, False]  # two turns kept as messages
        assert cleaned.reasons == {"no_final_assistant": 1} and cleaned.extra["mapped"] == {"message_lists": 2}


def test_chat_mapping_scored_messages_field(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"hello {i}"}],
             "score": i / 10} for i in range(3)]
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    cfg = IngestConfig(kind="scored", chat_mapping=ChatMapping(messages_field="messages"))
    cleaned = clean_logs(discover_inputs(str(src)), str(tmp_path / "c"), cfg)
    valid = validate_scored(str(tmp_path / "c"), str(tmp_path / "v"), cfg)
    got = pq.read_table(valid.outputs["scored"]).to_pylist()
    assert [(r["prompt"], r["response"], r["score"]) for r in got] == [("hi", "hello 0", 0.0), ("hi", "hello 1", 0.1),
                                                                       ("hi", "hello 2", 0.2)]
    assert cleaned.quarantined == 0


def test_scored_contract_types_and_finite_scores(tmp_path):
    rows = [{"prompt": "p", "response": "r1", "score": 1},
            {"prompt": "p", "response": "r2", "score": "high"},
            b'{"prompt": "p", "response": "r3", "score": NaN}\n',
            {"prompt": "p", "response": "r4", "score": True},
            {"prompt": "p", "response": "r5", "score": 0.5, "category": "c"}]
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    cfg = IngestConfig(kind="scored")
    cleaned = clean_logs(discover_inputs(str(src)), str(tmp_path / "c"), cfg)
    valid = validate_scored(str(tmp_path / "c"), str(tmp_path / "v"), cfg)
    assert cleaned.reasons == {"wrong_type": 2} and valid.reasons == {"non_finite_score": 1}
    assert pq.read_table(valid.outputs["scored"]).column("score").to_pylist() == [1.0, 0.5]


def test_long_prompt_filter_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rows = [{"prompt": " ".join(["a"] * n), "chosen": "x", "rejected": "y"} for n in (3, 8, 5)]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    _, valid = run(src, tmp_path / "o", IngestConfig(max_prompt_tokens=5, tokenizer_path=str(tmp_path)))
    assert valid.reasons == {"prompt_too_long": 1} and valid.valid == 2
    q = pq.read_table(valid.outputs["quarantine"]).to_pylist()[0]
    assert q["source_line"] == 2 and "8 tokens > 5" in q["detail"]


def test_check_reject_rate_gate():
    ok = StageReport("s", rows_in=100, valid=90, quarantined=5, duplicates=5, reasons={"empty_field": 5})
    passed, desc = check_reject_rate(ok, 0.05)
    assert passed and "5/100" in desc and "empty_field=5" in desc
    assert not check_reject_rate(StageReport("s", rows_in=100, valid=94, quarantined=6), 0.05)[0]
    broken = StageReport("s", rows_in=100, valid=90, quarantined=1)
    passed, desc = check_reject_rate(broken, 0.05)
    assert not passed and "invariant" in desc
    assert check_reject_rate(StageReport("s"), 0.05)[0]


def _digest(report):
    return {k: hashlib.sha256(open(v, "rb").read()).hexdigest() for k, v in report.outputs.items()}


def test_byte_identical_reruns_and_streaming_batches(tmp_path, sample_run):
    _, cleaned, valid = sample_run
    c2, v2 = run(SAMPLE, tmp_path / "again")
    assert _digest(c2) == _digest(cleaned) and _digest(v2) == _digest(valid)
    assert (c2.content_hash, v2.content_hash) == (cleaned.content_hash, valid.content_hash)
    small = IngestConfig(batch_rows=7, block_bytes=512)  # many tiny batches and blocks: same bytes
    c3, v3 = run(SAMPLE, tmp_path / "small", small)
    assert _digest(c3) == _digest(cleaned) and _digest(v3) == _digest(valid)
    assert c3.reasons == cleaned.reasons and v3.reasons == valid.reasons
    assert pq.ParquetFile(v3.outputs["preferences"]).metadata.num_row_groups == 1
    for threads in (1, 7):  # the default follows the host's CPUs: the bytes must not
        c4, v4 = run(SAMPLE, tmp_path / f"threads{threads}", small.model_copy(update={"threads": threads}))
        assert _digest(c4) == _digest(cleaned) and _digest(v4) == _digest(valid)


def test_default_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    from batchrl.ingest import config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(32)))
    assert IngestConfig().threads == config.MAX_DEFAULT_THREADS == 8
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {5})
    assert IngestConfig().threads == 1
    with pytest.raises(ValueError):
        IngestConfig(threads=0)


@pytest.mark.parametrize("cfg", [IngestConfig(fast_json=False), IngestConfig(engine="duckdb")],
                         ids=["reference", "duckdb"])
def test_fast_path_agrees_with_reference_path(tmp_path, sample_run, cfg):
    """The default (pyarrow.json) engine agrees byte for byte with the per-line reference path and the
    DuckDB engine, in both stages."""
    _, cleaned, valid = sample_run
    other = run(SAMPLE, tmp_path / "other", cfg)
    assert [_digest(r) for r in other] == [_digest(cleaned), _digest(valid)]
    assert [r.reasons for r in other] == [cleaned.reasons, valid.reasons]


def test_fused_single_pass_matches_two_stages(tmp_path, sample_run):
    from batchrl.ingest import ingest_logs

    _, cleaned, valid = sample_run
    c, v = ingest_logs(discover_inputs(SAMPLE), str(tmp_path / "fused"), IngestConfig())
    assert _digest(c) == _digest(cleaned) and _digest(v) == _digest(valid)
    assert (v.rows_in, v.valid, v.quarantined, v.duplicates) == (valid.rows_in, valid.valid, valid.quarantined,
                                                                 valid.duplicates)


def test_read_ahead_keeps_order_raises_in_place_and_closes_on_early_stop():
    from batchrl.ingest.clean import read_ahead

    assert list(read_ahead(iter(range(50)), 2)) == list(range(50))

    def failing():
        yield from range(3)
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in read_ahead(failing(), 2):
            got.append(item)
    assert got == [0, 1, 2]  # every item before the failure arrived, in order

    closed = []

    def endless():
        try:
            n = 0
            while True:
                yield n
                n += 1
        finally:
            closed.append(True)  # the open file of a real reader is closed here

    reader = read_ahead(endless(), 2)
    assert [next(reader) for _ in range(5)] == [0, 1, 2, 3, 4]
    reader.close()  # the caller stops early: the producer thread stops and closes its source
    assert closed == [True]
