"""The one-pass engine: masked block parse, Arrow UTF-8 check, numpy NFC check, Arrow twin of the
pandera checks, hashing sink, and ingest_logs without the intermediate cleaned file."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pandera.pandas as pandera
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers_ingest import tricky_lines

from batchrl.ingest import IngestConfig, discover_inputs, ingest_logs
from batchrl.ingest.jsonl import _utf8_valid
from batchrl.ingest.nfc import nfc_unstable_re, unstable_rows
from batchrl.schemas import ARROW_SCHEMAS, PANDERA_SCHEMAS, contract_violations, to_pandas


@pytest.mark.parametrize("data", [
    b"plain ascii", "caf\u00e9 \u6570\u636e \U0001f600".encode(), b"\xff", b"\xc0\xaf",  # overlong
    b"\xed\xa0\x80",  # UTF-8-encoded surrogate
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
    b"\xe6\x95", b"ok \xe6\x95\xb0 \xe6",  # truncated sequences
])
def test_arrow_utf8_check_agrees_with_python(data):
    try:
        data.decode("utf-8")
        python_ok = True
    except UnicodeDecodeError:
        python_ok = False
    padded = b"xx" + data + b"yy"
    assert _utf8_valid(pa.py_buffer(padded), 2, 2 + len(data)) == python_ok


def test_numpy_nfc_check_matches_the_regex():
    rng = random.Random(1)
    alphabet = [chr(c) for c in [*range(0x20, 0x7F), *range(0xA0, 0x800, 3), *range(0x300, 0x370),
                                 *range(0x1100, 0x1200), *range(0xAC00, 0xAC40), 0x212B, 0xFB1D, 0x1D15E, 0x10FFFF]]
    values = ["".join(rng.choices(alphabet, k=rng.randrange(0, 7))) for _ in range(30000)] + [None, ""]
    arr = pa.array(values).slice(5)  # a non-zero array offset
    expected = np.flatnonzero(pc.fill_null(pc.match_substring_regex(arr, nfc_unstable_re()), False)
                              .to_numpy(zero_copy_only=False))
    assert np.array_equal(unstable_rows(arr), expected) and len(expected) > 1000


def _pandera_reasons(table: pa.Table, kind: str) -> dict[int, str]:
    try:
        PANDERA_SCHEMAS[kind].validate(to_pandas(table), lazy=True)
        return {}
    except pandera.errors.SchemaErrors as err:
        order = {"not_nullable": 0, "empty_field": 1, "non_finite_score": 2, "chosen_equals_rejected": 3}
        found: dict[int, str] = {}
        for check, index in zip(err.failure_cases["check"], err.failure_cases["index"]):
            code = "missing_field" if check == "not_nullable" else check
            if index is not None and (int(index) not in found or order[check] < order.get(
                    "not_nullable" if found[int(index)] == "missing_field" else found[int(index)], 9)):
                found[int(index)] = code
        return found


@pytest.mark.parametrize("kind", ["preference", "scored", "feedback"])
def test_arrow_checks_agree_with_pandera(kind):
    rng = random.Random(2)
    texts = ["a", "b", "", None, "long text", "a"]
    n = 400
    cols = {name: [rng.choice(texts) for _ in range(n)] for name in ("prompt", "chosen", "rejected", "response",
                                                                      "completion")}
    data = {"id": [f"r{i}" for i in range(n)], "category": [None] * n, "source": [None] * n,
            "timestamp": [None] * n, "extra": [None] * n, "prompt_messages": [None] * n, "source_file": ["f"] * n,
            "source_line": list(range(n)), "label": [rng.choice([True, False, None]) for _ in range(n)],
            "score": [rng.choice([1.0, float("nan"), float("inf"), None, -2.5]) for _ in range(n)], **cols}
    table = pa.table({f.name: pa.array(data[f.name], f.type) for f in ARROW_SCHEMAS[kind]}, schema=ARROW_SCHEMAS[kind])
    arrow: dict[int, str] = {}
    for code, mask, _ in contract_violations(table, kind):
        for i in np.flatnonzero(mask):
            arrow.setdefault(int(i), code)
    assert arrow == _pandera_reasons(table, kind) and len(arrow) > n // 4


def test_one_pass_without_cleaned_file(tmp_path):
    src = tmp_path / "tricky.jsonl"
    src.write_bytes(tricky_lines())
    files = discover_inputs(str(src))
    cleaned, validated = ingest_logs(files, str(tmp_path / "two"), IngestConfig(block_bytes=1 << 16))
    _, alone = ingest_logs(files, str(tmp_path / "one"), IngestConfig(block_bytes=1 << 16), keep_cleaned=False)
    assert set(alone.outputs) == {"preferences", "quarantine"}
    out = pq.read_table(alone.outputs["preferences"])
    assert out.equals(pq.read_table(validated.outputs["preferences"]))
    assert alone.content_hash == validated.content_hash  # same bytes
    # every input row is accounted for in the one report; one quarantine holds both stages' reasons
    assert alone.invariant_holds and alone.rows_in == cleaned.rows_in
    assert alone.quarantined == cleaned.quarantined + validated.quarantined
    assert alone.reasons == {k: cleaned.reasons.get(k, 0) + validated.reasons.get(k, 0)
                             for k in set(cleaned.reasons) | set(validated.reasons)}
    quarantine = pq.read_table(alone.outputs["quarantine"])
    assert quarantine.num_rows == alone.quarantined + alone.duplicates
    for report in (validated, alone):  # the sink hashes while writing: the data version is the file's sha256
        with open(report.outputs["preferences"], "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == report.content_hash


@pytest.mark.parametrize("spill", [False, True])
def test_seen_keys_is_an_exact_set(tmp_path, spill):
    """Against a Python set; with spilling: tiny memory budget, tiny Bloom filter (many false positives),
    disk runs merged twice over, pages partly filled."""
    from batchrl.ingest.dedupe import PAGE_KEYS, SeenKeys

    rng = np.random.default_rng(0)
    options = dict(memory_keys=700, bloom_bits=1 << 12, max_run=300, max_disk_runs=2, spill_dir=str(tmp_path))
    seen, reference = (SeenKeys(**options) if spill else SeenKeys(max_run=1000)), set()
    for _ in range(80):
        batch = rng.integers(0, 20000, size=rng.integers(1, 300), dtype=np.uint64)
        unique = np.unique(batch)
        hit = seen.contains(unique)
        assert hit.tolist() == [int(k) in reference for k in unique]
        seen.add(unique[~hit])
        reference.update(int(k) for k in unique[~hit])
    assert len(seen) == len(reference)
    assert all(np.all(r[1:] > r[:-1]) for r in seen.runs)
    if spill:
        assert 1 <= len(seen.disk) <= 2 and sum(r.n for r in seen.disk) > 3 * PAGE_KEYS
        for run in seen.disk:  # every run file is sorted and its fences are every PAGE_KEYS-th key
            keys = run.read(0, run.n)
            assert np.all(keys[1:] > keys[:-1]) and np.array_equal(run.fences, keys[::PAGE_KEYS])
        seen.close()
        assert not list(tmp_path.iterdir())  # spill files removed


def test_spilled_dedupe_gives_the_same_output(tmp_path):
    """A dedupe budget of 64 keys (everything else on disk) writes the same bytes as the default."""
    src = tmp_path / "tricky.jsonl"
    src.write_bytes(tricky_lines() + tricky_lines())  # the second half repeats the first
    files = discover_inputs(str(src))
    _, default = ingest_logs(files, str(tmp_path / "a"), IngestConfig(block_bytes=1 << 15), keep_cleaned=False)
    _, spilled = ingest_logs(files, str(tmp_path / "b"), IngestConfig(
        block_bytes=1 << 15, dedupe_memory_keys=64, dedupe_spill_dir=str(tmp_path)), keep_cleaned=False)
    assert default.duplicates > 100 and spilled.to_metadata() | {"outputs": None, "seconds": None} == \
        default.to_metadata() | {"outputs": None, "seconds": None}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("batchrl-dedupe-")]


def test_files_listed_without_a_hash_are_hashed_in_the_same_read(tmp_path):
    """< 1 s. ``discover_inputs(hash_files=False)``: the one pass reports each file's sha256 (of the
    stored bytes: compressed for .gz) as discovery would have, for JSONL (read once) and Parquet."""
    import gzip
    import json

    lines = "".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(3000))
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text(lines)
    (src / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq.write_table(pa.table({"prompt": ["p1", "p2"], "chosen": ["c", "c"], "rejected": ["r", "r"]}),
                   src / "c.parquet")
    cfg = IngestConfig(block_bytes=65536)  # several blocks per file
    cleaned, _ = ingest_logs(discover_inputs(str(src), hash_files=False), str(tmp_path / "out"), cfg,
                             keep_cleaned=False)
    expected = {f.uri: f.sha256 for f in discover_inputs(str(src))}
    assert {f["uri"]: f["sha256"] for f in cleaned.extra["inputs"]} == expected
    assert expected[str(src / "a.jsonl")] == hashlib.sha256(lines.encode()).hexdigest()
