"""The bad-input corpus: every kind of broken file the data plane should survive, generated (not stored).

Each ``Case`` is one input file plus what must become of it: either a whole-file fault (``BAD_FILE``:
one ``bad_file`` quarantine entry with ``on_bad_file: skip``, named in the error with ``fail``) or row
outcomes (valid rows, quarantine reason counts, duplicates). ``records`` is counted here from the bytes
written, independently of the readers, so ``valid + quarantined + duplicates == records`` per file
proves that no row was lost. Cases share a drop per config ``group``.

    python tests/bad_inputs.py OUT_DIR          # write the corpus
    python tests/bad_inputs.py --table FILE     # run it and write the results table (docs/BAD_INPUTS.md)
"""
from __future__ import annotations

import gzip
import io
import itertools
import json
import os
import sys
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import zstandard

BAD_FILE = "bad_file"
BIG_LINE_BYTES = 50 << 20


@dataclass
class Case:
    name: str
    what: str               # the kind of bad input, in words (the docs table)
    filename: str
    data: bytes
    records: int            # rows the file holds, counted from the bytes written
    expect: str | dict      # BAD_FILE, or {"valid": n, "reasons": {...}, "duplicates": n}
    group: str = "preference"
    extra: dict = field(default_factory=dict)


_serial = itertools.count()


def row(i: int, **over) -> dict:
    """A valid record; every call a new prompt (files of one drop must not duplicate each other)."""
    base = {"prompt": f"What is {i} + {i}? (#{next(_serial)})", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
    base.update(over)
    return {k: v for k, v in base.items() if v is not ...}


def jl(*records, ensure_ascii: bool = False) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=ensure_ascii).encode()) + b"\n"
                    for r in records)


def good(n: int = 3, start: int = 0) -> list[dict]:
    return [row(start + i) for i in range(n)]


def lines_of(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.strip(b" \t\r"))


def ok(valid: int, duplicates: int = 0, **reasons) -> dict:
    return {"valid": valid, "reasons": reasons, "duplicates": duplicates}


def jsonl_case(name, what, data: bytes, expect, **kw) -> Case:
    return Case(name, what, kw.pop("filename", f"{name}.jsonl"), data, kw.pop("records", lines_of(data)), expect, **kw)


def parquet_bytes(table: pa.Table, **kw) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **kw)
    return sink.getvalue()


def arrow_file_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    feather.write_feather(table, sink, compression="uncompressed")
    return sink.getvalue()


def arrow_stream_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)
    return sink.getvalue()


def csv_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pacsv.write_csv(table, sink)
    return sink.getvalue()


def big_gzip_truncated() -> bytes:
    """A gzip whose first ~100 KB decompress fine (past the probe's head): the fault shows mid-stream."""
    rows = jl(*[row(i, chosen=f"{2 * i} " + "x" * 40) for i in range(4000)])
    whole = gzip.compress(rows, compresslevel=1, mtime=0)
    return whole[: int(len(whole) * 0.8)]


def fresh_table(n: int = 4) -> pa.Table:
    return pa.Table.from_pylist(good(n))


def cases(big_line: bool = True) -> list[Case]:
    global _serial
    _serial = itertools.count()  # the same corpus on every call
    zstd = zstandard.ZstdCompressor()
    c: list[Case] = []
    add = c.append
    # -- JSON lines: rows ----------------------------------------------------------------------------------
    add(jsonl_case("truncated_json", "JSON line cut mid-record", jl(*good(2)) + b'{"prompt": "p", "cho\n',
                   ok(2, invalid_json=1)))
    add(jsonl_case("trailing_comma", "trailing comma in an object", jl(row(0)) + b'{"prompt": "a", "chosen": "b", '
                   b'"rejected": "c",}\n', ok(1, invalid_json=1)))
    add(jsonl_case("bom_first_line", "UTF-8 BOM at file start", b"\xef\xbb\xbf" + jl(*good(3)), ok(3)))
    add(jsonl_case("bom_every_line", "UTF-8 BOM on every line", b"".join(b"\xef\xbb\xbf" + jl(r) for r in good(3)),
                   ok(3)))
    add(jsonl_case("latin1", "Latin-1 encoded file", jl(*good(1)) + json.dumps(row(5, chosen="café"),
                   ensure_ascii=False).encode("latin-1") + b"\n", ok(1, undecodable=1)))
    add(jsonl_case("mixed_encodings", "UTF-8, Latin-1 and cp1252 lines mixed",
                   jl(row(0, chosen="café")) + json.dumps(row(1, chosen="naïve"), ensure_ascii=False).encode("latin-1")
                   + b"\n" + json.dumps(row(2, chosen="“quoted”"), ensure_ascii=False).encode("cp1252") + b"\n",
                   ok(1, undecodable=2)))
    add(jsonl_case("nul_raw", "raw NUL bytes inside a value", jl(row(0)) + b'{"prompt": "a\x00b", "chosen": "c", '
                   b'"rejected": "d"}\n', ok(2)))
    add(jsonl_case("nul_escaped", "escaped \\u0000 in values", jl(row(0, prompt="nul\u0000here")), ok(1)))
    add(jsonl_case("nul_only_value", "value made of NUL only", jl(row(0, chosen="\u0000")), ok(0, empty_field=1)))
    add(jsonl_case("crlf", "CRLF line endings", jl(*good(3)).replace(b"\n", b"\r\n"), ok(3)))
    add(jsonl_case("lone_cr_in_value", "lone CR inside values", jl(row(0, prompt="a\rb"), row(1)), ok(2)))
    add(jsonl_case("cr_only_separators", "records separated by lone CR (old Mac)", jl(*good(3)).replace(b"\n", b"\r"),
                   ok(0, invalid_json=1), records=1))
    add(jsonl_case("duplicate_keys", "duplicate keys in a record (last wins)",
                   b'{"prompt": "p", "chosen": "a", "chosen": "c", "rejected": "b"}\n', ok(1)))
    add(jsonl_case("wrong_type", "number/bool where text is expected", jl(row(0, prompt=12), row(1, chosen=True),
                   row(2)), ok(1, wrong_type=2)))
    add(jsonl_case("missing_field", "a contract field absent", jl(row(0), row(1, rejected=...)), ok(1, missing_field=1)))
    add(jsonl_case("null_values", "null contract values", jl(row(0), row(1, chosen=None), row(2, prompt=None)),
                   ok(1, missing_field=2)))
    add(jsonl_case("extra_fields", "extra fields (score, model, ids)", jl(row(0, score=0.9, model="m1"),
                   row(1, request_id="r1")), ok(2)))
    add(jsonl_case("nested_chat_unmapped", "chat message lists without chat_mapping (recognised)",
                   jl(row(0, chosen=[{"role": "assistant", "content": "a"}]), row(1)), ok(2)))
    add(jsonl_case("nested_object", "object as a contract value", jl(row(0, prompt={"text": "p"}), row(1)),
                   ok(1, nested_value=1)))
    add(jsonl_case("not_object", "JSON array / number / string lines", jl([1, 2], 3, "text", row(0)),
                   ok(1, not_object=3)))
    add(jsonl_case("empty_file", "empty file (0 bytes)", b"", ok(0)))
    add(jsonl_case("whitespace_file", "whitespace-only file", b"\n  \n\t\n\r\n", ok(0)))
    add(jsonl_case("blank_lines", "blank lines between records", b"\n".join(jl(r) for r in good(3)), ok(3)))
    add(jsonl_case("whitespace_fields", "whitespace-only fields", jl(row(0, chosen="   "), row(1, prompt="\t\n"),
                   row(2)), ok(1, empty_field=2)))
    add(jsonl_case("identical_pair", "chosen identical to rejected", jl(row(0, chosen="x", rejected="x"), row(1)),
                   ok(1, chosen_equals_rejected=1)))
    add(jsonl_case("identical_after_cleaning", "chosen == rejected after trim/NFC",
                   jl(row(0, chosen=" caf\u00e9", rejected="cafe\u0301 "), row(1)), ok(1, chosen_equals_rejected=1)))
    first = row(0)
    add(jsonl_case("duplicates", "exact duplicate rows", jl(first, first, row(1), first), ok(2, duplicates=2)))
    add(jsonl_case("lone_surrogate", "lone surrogate \\ud800 escape", jl(row(0)) + rb'{"prompt": "x\ud800", '
                   rb'"chosen": "a", "rejected": "b"}' + b"\n", ok(1, undecodable=1)))
    add(jsonl_case("deep_nesting", "100k-deep nested array", jl(row(0)) + b"[" * 100_000 + b"]" * 100_000 + b"\n",
                   ok(1, invalid_json=1)))
    add(jsonl_case("invalid_escape", "invalid escape sequence", jl(row(0)) + rb'{"prompt": "bad \x", "chosen": "a", '
                   rb'"rejected": "b"}' + b"\n", ok(1, invalid_json=1)))
    add(jsonl_case("control_chars", "ANSI escapes and control characters in text",
                   jl(row(0, prompt="\x1b[31mred\x1b[0m\x07"), row(1, chosen="a\x0bb")), ok(2)))
    if big_line:
        big = json.dumps(row(0, prompt="w " * (BIG_LINE_BYTES // 2))).encode() + b"\n"
        add(jsonl_case("line_50mb", "one 50 MB line", big + jl(row(1)), ok(2)))
    # -- JSON lines: other configurations -----------------------------------------------------------------------
    add(jsonl_case("overlong_prompt", "prompt over max_prompt_tokens", jl(row(0, prompt="word " * 80), row(1)),
                   ok(1, prompt_too_long=1), group="tokens"))
    add(jsonl_case("nested_chat_mapped", "chat message lists with chat_mapping",
                   jl({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                       "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}),
                   ok(1), group="chat"))
    add(jsonl_case("nan_inf_scores", "NaN / inf / huge scores", b'{"prompt": "p", "response": "r", "score": NaN}\n'
                   b'{"prompt": "p", "response": "r2", "score": Infinity}\n'
                   b'{"prompt": "p", "response": "r3", "score": 1e400}\n'
                   b'{"prompt": "p", "response": "r4", "score": "high"}\n'
                   b'{"prompt": "p", "response": "r5", "score": 0.5}\n', ok(1, non_finite_score=3, wrong_type=1),
                   group="scored"))
    add(jsonl_case("extra_fields_strict", "extra field later in a file, extra_fields: error",
                   jl(row(0), row(1, model="m")), ok(1, extra_field=1), group="strict"))
    add(jsonl_case("extra_fields_strict_first", "extra field in the first record, extra_fields: error",
                   jl(row(0, model="m"), row(1)), BAD_FILE, group="strict"))
    add(jsonl_case("extra_fields_quarantined", "extra fields, extra_fields: quarantine",
                   jl(row(0, model="m"), row(1)), ok(1, extra_field=1), group="quarantine"))
    add(jsonl_case("extra_fields_dropped", "extra fields, extra_fields: drop", jl(row(0, model="m"), row(1)), ok(2),
                   group="drop"))
    # -- JSON lines: whole-file faults --------------------------------------------------------------------------
    add(jsonl_case("other_field_names", "records with other field names (no mapping)",
                   jl({"instruction": "q", "best": "a", "worst": "b"}), BAD_FILE))
    gz = gzip.compress(jl(*good(50)), mtime=0)
    add(jsonl_case("gzip_truncated", "gzip ending early", gz[: len(gz) // 2], BAD_FILE, filename="gzip_truncated.jsonl.gz",
                   records=0))
    add(jsonl_case("gzip_truncated_late", "gzip ending early after 100 KB (fault found mid-stream)",
                   big_gzip_truncated(), BAD_FILE, filename="gzip_truncated_late.jsonl.gz", records=0))
    corrupt = bytearray(gz)
    corrupt[len(corrupt) // 2] ^= 0xFF
    add(jsonl_case("gzip_corrupt", "gzip with a flipped byte (CRC/deflate error)", bytes(corrupt), BAD_FILE,
                   filename="gzip_corrupt.jsonl.gz", records=0))
    add(jsonl_case("gzip_trailing_garbage", "gzip followed by garbage bytes", gz + b"garbage!", BAD_FILE,
                   filename="gzip_trailing_garbage.jsonl.gz", records=0))
    add(jsonl_case("gzip_multi_member", "concatenated gzip members", gzip.compress(jl(row(0)), mtime=0)
                   + gzip.compress(jl(row(1)), mtime=0), ok(2), filename="gzip_multi_member.jsonl.gz", records=2))
    add(jsonl_case("gzip_empty_payload", "valid gzip of nothing", gzip.compress(b"", mtime=0), ok(0),
                   filename="gzip_empty_payload.jsonl.gz", records=0))
    add(jsonl_case("gzip_zero_bytes", "0-byte file named .gz", b"", BAD_FILE, filename="gzip_zero_bytes.jsonl.gz",
                   records=0))
    zs = zstd.compress(jl(*good(50)))
    add(jsonl_case("zstd_truncated", "zstd ending early", zs[: len(zs) // 2], BAD_FILE,
                   filename="zstd_truncated.jsonl.zst", records=0))
    add(jsonl_case("zstd_ok", "zstd compressed", zs, ok(50), filename="zstd_ok.jsonl.zst", records=50))
    add(jsonl_case("gzip_named_jsonl", "gzip content named .jsonl", gz, BAD_FILE, records=0))
    add(jsonl_case("plain_named_gz", "plain JSONL named .jsonl.gz", jl(*good(2)), BAD_FILE,
                   filename="plain_named_gz.jsonl.gz", records=0))
    add(jsonl_case("parquet_named_jsonl", "Parquet content named .jsonl", parquet_bytes(fresh_table()), BAD_FILE, records=0))
    add(jsonl_case("csv_named_jsonl", "CSV content named .jsonl", csv_bytes(fresh_table()), BAD_FILE, records=0))
    # -- CSV -----------------------------------------------------------------------------------------------------
    add(Case("csv_ok", "CSV with header", "csv_ok.csv", csv_bytes(fresh_table()), 4, ok(4)))
    add(Case("csv_wrong_columns", "CSV line with too many / too few columns", "csv_wrong_columns.csv",
             csv_bytes(fresh_table()) + b'"p9","a","b","surplus"\n"p10","a"\n', 6, ok(4, invalid_csv_row=2)))
    add(Case("csv_bom_crlf", "CSV with BOM and CRLF", "csv_bom_crlf.csv",
             b"\xef\xbb\xbf" + csv_bytes(fresh_table()).replace(b"\n", b"\r\n"), 4, ok(4)))
    add(Case("csv_quoted_newlines", "CSV values with quoted newlines", "csv_quoted_newlines.csv",
             b'prompt,chosen,rejected\n"multi\nline",a,b\n"p2",c,d\n', 2, ok(2)))
    add(Case("csv_extra_column", "CSV with extra columns", "csv_extra_column.csv",
             b"prompt,chosen,rejected,model\np,a,b,m1\nq,c,d,\n", 2, ok(2)))
    add(Case("csv_missing_column", "CSV header without a contract column", "csv_missing_column.csv",
             b"prompt,chosen,answer\np,a,b\n", 0, BAD_FILE))
    add(Case("csv_empty", "empty CSV (0 bytes)", "csv_empty.csv", b"", 0, ok(0)))
    add(Case("csv_empty_fields", "CSV with empty values", "csv_empty_fields.csv", b"prompt,chosen,rejected\np,,b\n,a,b\n",
             2, ok(0, empty_field=2)))
    add(Case("json_named_csv", "JSON lines named .csv", "json_named_csv.csv", jl(*good(2)), 0, BAD_FILE))
    # -- Parquet ---------------------------------------------------------------------------------------------------
    pqb = parquet_bytes(fresh_table())
    add(Case("parquet_ok", "Parquet", "parquet_ok.parquet", pqb, 4, ok(4)))
    add(Case("parquet_footer_cut", "Parquet with its footer cut off", "parquet_footer_cut.parquet", pqb[:-10], 0,
             BAD_FILE))
    add(Case("parquet_footer_garbled", "Parquet with a garbled footer", "parquet_footer_garbled.parquet",
             pqb[:-40] + b"\xff" * 32 + pqb[-8:], 0, BAD_FILE))
    add(Case("parquet_zero_rows", "Parquet with zero rows", "parquet_zero_rows.parquet",
             parquet_bytes(fresh_table().slice(0, 0)), 0, ok(0)))
    add(Case("parquet_wrong_types", "Parquet with an int column for prompt", "parquet_wrong_types.parquet",
             parquet_bytes(pa.table({"prompt": [1, 2], "chosen": ["a", "b"], "rejected": ["c", "d"]})), 2,
             ok(0, wrong_type=2)))
    add(Case("parquet_nulls", "Parquet with null values", "parquet_nulls.parquet",
             parquet_bytes(pa.table({"prompt": ["p", None], "chosen": ["a", "b"], "rejected": ["c", "d"]})), 2,
             ok(1, missing_field=1)))
    add(Case("parquet_nested", "Parquet with a list<struct> chat column", "parquet_nested.parquet",
             parquet_bytes(pa.table({"prompt": ["p", "q"], "chosen": [[{"role": "assistant", "content": "a chat"}], None],
                                     "rejected": ["c", "d"]})), 2, ok(1, missing_field=1)))
    add(Case("parquet_extra_columns", "Parquet with extra columns (score, model, ts)", "parquet_extra_columns.parquet",
             parquet_bytes(fresh_table().append_column("score", pa.array([0.1, 0.2, None, 0.4]))
                           .append_column("ts", pa.array([1, 2, 3, 4], pa.timestamp("s")))), 4, ok(4)))
    add(Case("parquet_missing_column", "Parquet without a contract column", "parquet_missing_column.parquet",
             parquet_bytes(fresh_table().drop_columns(["rejected"])), 0, BAD_FILE))
    add(Case("parquet_dictionary", "Parquet with dictionary-encoded large strings", "parquet_dictionary.parquet",
             parquet_bytes(pa.table({"prompt": pa.array(["p-dict", "q-dict"]).dictionary_encode(),
                                     "chosen": pa.array(["a", "b"], pa.large_string()),
                                     "rejected": ["c", "d"]})), 2, ok(2)))
    add(Case("jsonl_named_parquet", "JSON lines named .parquet", "jsonl_named_parquet.parquet", jl(*good(2)), 0,
             BAD_FILE))
    add(Case("parquet_empty_file", "0-byte .parquet", "parquet_empty_file.parquet", b"", 0, BAD_FILE))
    # -- Arrow IPC ---------------------------------------------------------------------------------------------------
    add(Case("arrow_file_ok", "Arrow IPC file (feather v2)", "arrow_file_ok.arrow", arrow_file_bytes(fresh_table()), 4, ok(4)))
    add(Case("arrow_stream_ok", "Arrow IPC stream", "arrow_stream_ok.arrow", arrow_stream_bytes(fresh_table()), 4, ok(4)))
    af = arrow_file_bytes(fresh_table())
    add(Case("arrow_footer_cut", "Arrow IPC file with its footer cut off", "arrow_footer_cut.arrow", af[:-20], 0,
             BAD_FILE))
    st = arrow_stream_bytes(fresh_table())
    add(Case("arrow_stream_truncated", "Arrow IPC stream ending mid-batch", "arrow_stream_truncated.arrow",
             st[: len(st) - 30], 0, BAD_FILE))
    add(Case("arrow_zero_rows", "Arrow IPC file with zero rows", "arrow_zero_rows.arrow",
             arrow_file_bytes(fresh_table().slice(0, 0)), 0, ok(0)))
    add(Case("arrow_garbage", "random bytes named .arrow", "arrow_garbage.arrow", bytes(range(256)) * 4, 0, BAD_FILE))
    return c


GROUPS = {
    "preference": {},
    "tokens": {"max_prompt_tokens": 50},
    "chat": {"chat_mapping": {}},
    "scored": {"kind": "scored"},
    "strict": {"extra_fields": "error"},
    "quarantine": {"extra_fields": "quarantine"},
    "drop": {"extra_fields": "drop"},
}


def write(folder: str, corpus: list[Case]) -> dict[str, str]:
    """Write each group's cases under ``folder/<group>/``; -> case name -> path."""
    paths = {}
    for case in corpus:
        path = os.path.join(folder, case.group, case.filename)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(case.data)
        paths[case.name] = path
    return paths


def config_for(group: str, **over):
    from batchrl.ingest import ChatMapping, IngestConfig

    opts = dict(GROUPS[group])
    if "chat_mapping" in opts:
        opts["chat_mapping"] = ChatMapping(**opts["chat_mapping"])
    return IngestConfig(**{**opts, **over})


def outcomes(out_dir: str, validated_name: str) -> dict[str, dict]:
    """Per source file, from the outputs alone: valid rows, quarantine reasons, duplicates."""
    valid = pq.read_table(os.path.join(out_dir, validated_name), columns=["source_file"]).column(0).to_pylist()
    quarantine = pq.read_table(os.path.join(out_dir, "quarantine.parquet")).to_pylist()
    result: dict[str, dict] = {}
    for uri in valid:
        result.setdefault(uri, ok(0))["valid"] += 1
    for q in quarantine:
        entry = result.setdefault(q["source_file"], ok(0))
        if q["reason"] == "duplicate":
            entry["duplicates"] += 1
        else:
            entry["reasons"][q["reason"]] = entry["reasons"].get(q["reason"], 0) + 1
    return result


def run_group(folder: str, group: str, out_dir: str, **over):
    """Ingest one group's drop in one pass (clean + contract); -> (cleaned, validated) reports."""
    from batchrl.ingest import discover_inputs, ingest_logs

    cfg = config_for(group, **over)
    return ingest_logs(discover_inputs(os.path.join(folder, group)), out_dir, cfg, keep_cleaned=False)


def _short_cause(cause: str, uri: str) -> str:
    cause = cause.replace(uri, "").replace(os.path.basename(uri), "FILE").lstrip(":0123456789 ")
    cause = cause.split(" (map other names")[0].replace("|", "/")
    cause = "".join(c if c.isprintable() else " " for c in cause)
    return cause if len(cause) <= 90 else cause[:87] + "..."


def table_markdown(folder: str, corpus: list[Case], work: str) -> str:
    rows = ["| # | kind of bad input | file | outcome (`on_bad_file: skip`; with `fail` the run stops naming "
            "every bad file) | rows in file | lost rows |", "|---|---|---|---|---:|---:|"]
    by_group: dict[str, dict] = {}
    causes: dict[str, str] = {}
    for group in sorted({c.group for c in corpus}):
        _, report = run_group(folder, group, os.path.join(work, group), on_bad_file="skip")
        causes.update({b["uri"]: b["cause"] for b in report.extra["bad_files"]})
        name = "scored.parquet" if group == "scored" else "preferences.parquet"
        by_group[group] = outcomes(os.path.join(work, group), name)
    for k, case in enumerate(corpus, start=1):
        uri = os.path.abspath(os.path.join(folder, case.group, case.filename))
        got = by_group[case.group].get(case.filename, ok(0))  # source_file: relative to the landing folder
        if got["reasons"].get(BAD_FILE):
            outcome = f"whole file: `bad_file` entry, cause: {_short_cause(causes[uri], uri)}"
            records, lost = "(not read)", "0 (file recorded)"
        else:
            parts = [f"{got['valid']} valid"] + [f"{n} `{r}`" for r, n in sorted(got["reasons"].items())]
            if got["duplicates"]:
                parts.append(f"{got['duplicates']} `duplicate`")
            outcome = ", ".join(parts)
            records = case.records
            lost = case.records - got["valid"] - sum(got["reasons"].values()) - got["duplicates"]
        config = "" if case.group == "preference" else f" (config: {case.group})"
        rows.append(f"| {k} | {case.what}{config} | `{case.filename}` | {outcome} | {records} | {lost} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:2] == ["--table"]:
        with tempfile.TemporaryDirectory() as tmp:
            corpus = cases()
            write(os.path.join(tmp, "in"), corpus)
            text = table_markdown(os.path.join(tmp, "in"), corpus, os.path.join(tmp, "out"))
        with open(sys.argv[2], "w") as f:
            f.write(text)
    else:
        print(len(write(sys.argv[1], cases())), "files written")
