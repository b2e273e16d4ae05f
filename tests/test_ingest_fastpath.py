"""The vectorised JSONL engines (pyarrow.json, DuckDB) must agree byte for byte with the per-line reference path."""
from __future__ import annotations

import hashlib
import random
import unicodedata

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers_ingest import tricky_lines

from batchrl.ingest import IngestConfig, clean_logs, discover_inputs, ingest_logs
from batchrl.ingest.nfc import nfc_unstable_re, unstable_chars
from batchrl.ingest.nfc_table import UNIDATA_VERSION, UNSTABLE_RANGES


def _digests(report):
    return {k: hashlib.sha256(open(v, "rb").read()).hexdigest() for k, v in report.outputs.items()}


@pytest.mark.parametrize("engine,extra_fields", [("arrow", "keep"), ("duckdb", "keep"), ("arrow", "error"),
                                                 ("arrow", "drop"), ("duckdb", "quarantine")])
@pytest.mark.parametrize("block_bytes", [1 << 20, 4096])
def test_fast_and_reference_paths_agree(tmp_path, block_bytes, engine, extra_fields):
    src = tmp_path / "tricky.jsonl"
    src.write_bytes(tricky_lines())
    files = discover_inputs(str(src))
    fast = clean_logs(files, str(tmp_path / "fast"), IngestConfig(block_bytes=block_bytes, engine=engine,
                                                                  extra_fields=extra_fields))
    ref = clean_logs(files, str(tmp_path / "ref"), IngestConfig(fast_json=False, extra_fields=extra_fields))
    rejects_extras = extra_fields in ("quarantine", "error")
    assert fast.reasons == ref.reasons and len(fast.reasons) == 4 + rejects_extras
    assert fast.extra["extra_fields"] == ref.extra["extra_fields"] == {"extra": 65}
    assert _digests(fast) == _digests(ref)
    assert fast.invariant_holds and fast.rows_in == 3000 - sum(1 for l in tricky_lines().split(b"\n")[:-1]
                                                               if not l.strip())


EDGE_LINES = [
    b'{"prompt": "p1", "chosen": "a", "rejected": "b",}',                 # trailing comma: DuckDB accepts
    b'{"prompt": "p2", "chosen": "a", "chosen": "c", "rejected": "b"}',   # duplicate key: Python keeps the last
    rb'{"prompt": "tab\there", "chosen": "a\u0085", "rejected": "b\u007f"}',
    b'{"prompt": "raw\ttab", "chosen": "c1 \xc2\x85 x", "rejected": "del \x7f"}',
    b'\xef\xbb\xbf{"prompt": "bom", "chosen": "a", "rejected": "b"}\r',
    b'{"prompt": "crlf", "chosen": "a", "rejected": "b"}\r\r',
    b'  {"prompt": "pad", "chosen": "a", "rejected": "b"}  ',
    b'{"prompt": "meta", "chosen": "a", "rejected": "b", "id": 7, "source": null, "timestamp": true}',
    b'{"prompt": "n", "chosen": null, "rejected": "b"}',
    b'{"prompt": "s", "chosen": ["x"], "rejected": "b"}',
    rb'{"prompt": "pair \ud83d\ude00", "chosen": "a", "rejected": "b"}',  # surrogate pair escape
    rb'{"prompt": "lone \ud800", "chosen": "a", "rejected": "b"}',       # json.loads accepts, Arrow cannot store
    rb'{"prompt": "p", "chosen": "a", "rejected": "b", "source": "\udc00"}',
    rb'{"prompt": "ws", "chosen": "a\u2003", "rejected": "\u00a0b"}',
    b'{"prompt": "unterminated',
    b'[1, 2]',
    b'\t ',
    b'{"prompt": "p1", "chosen": "a", "rejected": "b"}',                  # duplicate of line 1 after parse
]
SCORED_LINES = [
    b'{"prompt": "p", "response": "r", "score": 1}',
    b'{"prompt": "p", "response": "r2", "score": NaN}',
    b'{"prompt": "p", "response": "r3", "score": 1e400}',
    b'{"prompt": "p", "response": "r4", "score": 123456789012345678901234567890}',
    b'{"prompt": "p", "response": "r5", "score": "1.5"}',
    b'{"prompt": "p", "response": "r6", "score": 0.1}',
    b'{"prompt": "p", "response": "r7", "score": true}',
]


@pytest.mark.parametrize("kind,lines", [("preference", EDGE_LINES), ("scored", SCORED_LINES)])
def test_engines_edge_cases_match_reference(tmp_path, kind, lines):
    """Lines where DuckDB's or Arrow's JSON reading differs from Python's must still give the reference answer."""
    src = tmp_path / "edge.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    files = discover_inputs(str(src))
    runs = {}
    for name, cfg in {"duckdb": IngestConfig(kind=kind, engine="duckdb"),
                      "arrow": IngestConfig(kind=kind, engine="arrow"),
                      "ref": IngestConfig(kind=kind, fast_json=False)}.items():
        cleaned, validated = ingest_logs(files, str(tmp_path / name), cfg)
        assert cleaned.invariant_holds and validated.invariant_holds
        runs[name] = (cleaned.reasons, validated.reasons, _digests(cleaned), _digests(validated))
    assert runs["duckdb"] == runs["ref"] == runs["arrow"]
    if kind == "preference":
        assert runs["ref"][0]["undecodable"] == 2  # the lone surrogates


def test_nfc_table_is_current():
    if UNIDATA_VERSION != unicodedata.unidata_version:
        pytest.skip("python's unicodedata differs from the committed table's version")
    assert [tuple(r) for r in UNSTABLE_RANGES] == unstable_chars()


def test_nfc_quick_check_never_misses():
    """Strings without a flagged character are NFC already (random strings over the whole BMP)."""
    rng = random.Random(0)
    pattern = nfc_unstable_re()
    strings = ["".join(chr(rng.choice([rng.randrange(0x20, 0x3000), rng.randrange(0xAC00, 0xD7A4),
                                      rng.randrange(0x300, 0x370)])) for _ in range(6)) for _ in range(20000)]
    strings = [s for s in strings if not any(0xD800 <= ord(c) < 0xE000 for c in s)]
    flagged = pc.match_substring_regex(pa.array(strings), pattern).to_pylist()
    for s, hit in zip(strings, flagged):
        if not hit:
            assert unicodedata.is_normalized("NFC", s), ascii(s)
