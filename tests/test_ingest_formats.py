"""Every input format, local and on S3 (moto server), plus discovery and the custom reader plug-in."""
from __future__ import annotations

import gzip
import json
import os

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import zstandard

from batchrl.ingest import IngestConfig, IngestError, clean_logs, discover_inputs, validate_preferences

ROWS = [{"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}",
         "category": "math" if i % 2 else "other"} for i in range(40)]
ROWS[5]["chosen"] = ""  # one contract failure in every format


def write_all_formats(folder) -> dict[str, str]:
    os.makedirs(folder, exist_ok=True)
    jsonl = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    table = pa.Table.from_pylist(ROWS)
    paths = {
        "jsonl": os.path.join(folder, "a.jsonl"), "jsonl.gz": os.path.join(folder, "b.jsonl.gz"),
        "jsonl.zst": os.path.join(folder, "c.jsonl.zst"), "parquet": os.path.join(folder, "d.parquet"),
        "arrow": os.path.join(folder, "e.arrow"), "feather": os.path.join(folder, "f.feather"),
        "csv": os.path.join(folder, "g.csv"),
    }
    open(paths["jsonl"], "wb").write(jsonl)
    open(paths["jsonl.gz"], "wb").write(gzip.compress(jsonl, mtime=0))
    open(paths["jsonl.zst"], "wb").write(zstandard.ZstdCompressor().compress(jsonl))
    pq.write_table(table, paths["parquet"])
    with pa.ipc.new_stream(paths["arrow"], table.schema) as w:  # IPC stream format
        w.write_table(table, max_chunksize=7)
    feather.write_feather(table, paths["feather"])  # IPC file format
    pacsv.write_csv(table, paths["csv"])
    return paths


def _ingest(uri, out, **opts):
    cfg = IngestConfig(**opts)
    files = discover_inputs(uri, cfg.storage_options)
    cleaned = clean_logs(files, f"{out}/cleaned", cfg)
    valid = validate_preferences(f"{out}/cleaned", f"{out}/valid", cfg)
    return files, cleaned, valid


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "feather", "csv"])
def test_each_format_gives_the_same_rows(tmp_path, fmt):
    paths = write_all_formats(tmp_path / "in")
    _, cleaned, valid = _ingest(paths[fmt], tmp_path / "out")
    assert (cleaned.rows_in, valid.valid, valid.quarantined, valid.reasons) == (40, 39, 1, {"empty_field": 1})
    got = pq.read_table(valid.outputs["preferences"])
    assert got.column("prompt").to_pylist() == [r["prompt"] for i, r in enumerate(ROWS) if i != 5]
    assert got.column("category").to_pylist()[:2] == ["other", "math"]
    q = pq.read_table(valid.outputs["quarantine"]).to_pylist()[0]
    assert q["source_line"] == (7 if fmt == "csv" else 6) and q["source_file"].endswith(os.path.basename(paths[fmt]))


def test_discover_folder_glob_and_formats(tmp_path):
    paths = write_all_formats(tmp_path / "in")
    (tmp_path / "in" / "_SUCCESS").write_text("")
    (tmp_path / "in" / "notes.txt").write_text("not data")
    found = discover_inputs(str(tmp_path / "in"))
    assert [f.format for f in found] == ["jsonl", "jsonl", "jsonl", "parquet", "arrow", "arrow", "csv"]
    assert [f.compression for f in found][:3] == [None, "gzip", "zstd"]
    assert found == sorted(found, key=lambda f: f.uri) and all(len(f.sha256) == 64 for f in found)
    assert [f.uri for f in discover_inputs(str(tmp_path / "in" / "*.jsonl*"))] == [
        paths["jsonl"], paths["jsonl.gz"], paths["jsonl.zst"]]
    with pytest.raises(FileNotFoundError):
        discover_inputs(str(tmp_path / "missing"))


def test_all_formats_together_on_s3(tmp_path, s3_options):
    import s3fs

    paths = write_all_formats(tmp_path / "in")
    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("ingest-bucket")
    fs.put(str(tmp_path / "in") + "/", "ingest-bucket/drop/", recursive=True)
    found = discover_inputs("s3://ingest-bucket/drop", s3_options)
    assert len(found) == len(paths) and all(f.uri.startswith("s3://ingest-bucket/drop/") for f in found)
    _, cleaned, valid = _ingest("s3://ingest-bucket/drop", "s3://ingest-bucket/out", storage_options=s3_options)
    assert (cleaned.rows_in, valid.valid, valid.quarantined) == (280, 39, 7)
    assert valid.duplicates == 280 - 39 - 7 and valid.outputs["preferences"].startswith("s3://")
    assert fs.exists("ingest-bucket/out/valid/preferences.parquet")
    assert not [p for p in fs.find("ingest-bucket/out") if ".tmp" in p]
    _, _, local = _ingest(str(tmp_path / "in"), tmp_path / "local")
    # same rows and same bytes as the local run except for the source_file column
    s3_rows = pq.read_table(fs.open("ingest-bucket/out/valid/preferences.parquet")).drop_columns(["source_file"])
    assert s3_rows.equals(pq.read_table(local.outputs["preferences"]).drop_columns(["source_file"]))


def test_custom_reader_plugin(tmp_path):
    tsv = tmp_path / "logs" / "drop.tsv"
    tsv.parent.mkdir()
    tsv.write_text("prompt\tchosen\trejected\tcategory\n"
                   "Say hi\tHello there!\\nHow are you?\thi\twriting\n"
                   "broken line\tonly two\n"
                   "What is 2 + 2?\t4\t5\tmath\n")
    assert discover_inputs(str(tmp_path / "logs")) == []  # unknown format: only via glob or include_unknown
    files = discover_inputs(str(tmp_path / "logs" / "*.tsv"))
    assert files[0].format == "unknown"
    with pytest.raises(IngestError, match="reader"):
        clean_logs(files, str(tmp_path / "x"), IngestConfig())
    cfg = IngestConfig(reader="batchrl.ingest.tsv_reader:TsvReader")
    report = clean_logs(files, str(tmp_path / "out"), cfg)
    assert (report.rows_in, report.valid, report.reasons) == (3, 2, {"reader_error": 1})
    rows = pq.read_table(report.outputs["cleaned"]).to_pylist()
    assert rows[0]["chosen"] == "Hello there!\nHow are you?" and rows[1]["source_line"] == 4
    q = pq.read_table(report.outputs["quarantine"]).to_pylist()
    assert q[0]["source_line"] == 3 and q[0]["raw"] == "broken line\tonly two"


def test_csv_header_missing_contract_column_is_a_file_error(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("prompt,answer,rejected\nq,a,b\n")
    with pytest.raises(IngestError) as err:
        clean_logs(discover_inputs(str(p)), str(tmp_path / "out"), IngestConfig())
    msg = str(err.value)
    assert "bad.csv:1" in msg and "missing fields ['chosen']" in msg and "extra fields ['answer']" in msg
    assert not os.path.exists(tmp_path / "out" / "cleaned.parquet")
