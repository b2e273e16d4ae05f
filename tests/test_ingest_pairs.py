"""Scored logs -> preference pairs (best vs worst per prompt) through the same contract."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq

from batchrl.ingest import IngestConfig, check_reject_rate, clean_logs, discover_inputs, scored_to_pairs, validate_scored

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scored_pipeline(src, out, **pair_opts):
    cfg = IngestConfig(kind="scored")
    clean_logs(discover_inputs(str(src)), f"{out}/c", cfg)
    scored = validate_scored(f"{out}/c", f"{out}/s", cfg)
    pairs = scored_to_pairs(f"{out}/s", f"{out}/p", IngestConfig(**pair_opts))
    return scored, pairs


def test_best_vs_worst_margin_ties_and_category(tmp_path):
    rows = [
        {"prompt": "A", "response": "mid", "score": 0.5, "category": "math"},
        {"prompt": "B", "response": "only", "score": 1.0},
        {"prompt": "A", "response": "best", "score": 0.9, "category": "math"},
        {"prompt": "C", "response": "c1", "score": 0.3, "category": "writing"},
        {"prompt": "A", "response": "worst", "score": 0.1, "category": "math"},
        {"prompt": "C", "response": "c2", "score": 0.35, "category": "writing"},
        {"prompt": "D", "response": "tie-first", "score": 0.7},
        {"prompt": "D", "response": "tie-second", "score": 0.7},
        {"prompt": "E", "response": "same", "score": 0.9},
        {"prompt": "E", "response": "same", "score": 0.1},
        {"prompt": "F", "response": "f-top", "score": 2.0},
        {"prompt": "F", "response": "f-low", "score": 0.0},
        {"prompt": "F", "response": "f-top2", "score": 2.0},
    ]
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scored, pairs = scored_pipeline(src, tmp_path / "o", pair_min_margin=0.1)
    assert scored.valid == 13
    got = pq.read_table(pairs.outputs["pairs"]).to_pylist()
    assert [(r["prompt"], r["chosen"], r["rejected"], r["category"]) for r in got] == [
        ("A", "best", "worst", "math"), ("F", "f-top", "f-low", None)]
    assert got[0]["source_line"] == 3 and len(got[0]["id"]) == 32
    assert pairs.reasons == {"single_response": 1, "below_margin": 2, "chosen_equals_rejected": 1}
    assert (pairs.rows_in, pairs.valid, pairs.quarantined) == (6, 2, 4) and pairs.invariant_holds
    q = {r["reason"]: r for r in pq.read_table(pairs.outputs["quarantine"]).to_pylist()}
    assert json.loads(q["single_response"]["raw"])["prompt"] == "B"


def test_sample_scored_pairs_pass_gate_and_rerun_identically(tmp_path):
    sample = os.path.join(REPO, "sample_data", "scored")
    _, pairs = scored_pipeline(sample, tmp_path / "a")
    _, again = scored_pipeline(sample, tmp_path / "b", batch_rows=5)
    assert pairs.valid >= 35 and check_reject_rate(pairs, 0.05)[0]
    assert pairs.content_hash == again.content_hash
    table = pq.read_table(pairs.outputs["pairs"])
    assert set(table.column("category").to_pylist()) == {"math", "writing", "coding"}
    assert table.schema.names == ["id", "prompt", "chosen", "rejected", "category", "source", "timestamp",
                                  "extra", "prompt_messages", "source_file", "source_line"]


def test_scored_pipeline_on_s3(s3_options, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("scored-bucket")
    fs.put(os.path.join(REPO, "sample_data", "scored") + "/", "scored-bucket/in/", recursive=True)
    cfg = IngestConfig(kind="scored", storage_options=s3_options)
    clean_logs(discover_inputs("s3://scored-bucket/in", s3_options), "s3://scored-bucket/c", cfg)
    validate_scored("s3://scored-bucket/c", "s3://scored-bucket/s", cfg)
    pairs = scored_to_pairs("s3://scored-bucket/s", "s3://scored-bucket/p", IngestConfig(storage_options=s3_options))
    _, local = scored_pipeline(os.path.join(REPO, "sample_data", "scored"), tmp_path / "local")
    assert pairs.outputs["pairs"] == "s3://scored-bucket/p/pairs.parquet"
    assert (pairs.valid, pairs.quarantined) == (local.valid, local.quarantined)


def test_duckdb_reads_object_store_through_registered_s3fs(s3_options):
    """DuckDB reaches S3 through ``register_filesystem(s3fs)`` (no httpfs download)."""
    import pyarrow as pa
    import s3fs

    from batchrl.common.fsutil import duckdb_for

    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("duck-bucket")
    with fs.open("duck-bucket/t.parquet", "wb") as f:
        pq.write_table(pa.table({"x": [1, 2, 3]}), f)
    con = duckdb_for(["s3://duck-bucket/t.parquet"], s3_options)
    assert any("s3" in name.lower() for name in con.list_filesystems())
    assert con.sql("SELECT sum(x) FROM read_parquet('s3://duck-bucket/t.parquet')").fetchall() == [(6,)]
