"""The bad-input corpus (tests/bad_inputs.py): every file accounted for, row by row, under both policies."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import bad_inputs as corpus_lib
from batchrl.ingest import REASONS, IngestConfig, IngestError, clean_logs, discover_inputs, ingest_logs
from batchrl.ingest.faults import BadInputFiles

CORPUS = corpus_lib.cases(big_line=False)  # the 50 MB line has its own test (memory, in a subprocess)
GROUPS = sorted({c.group for c in CORPUS})
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("corpus"))
    corpus_lib.write(folder, CORPUS)
    return folder


def test_corpus_covers_forty_kinds_in_every_format():
    formats = {c.filename.split(".", 1)[1] for c in CORPUS}
    assert len(CORPUS) >= 40 and {"jsonl", "jsonl.gz", "jsonl.zst", "csv", "parquet", "arrow"} <= formats
    assert sum(c.expect == corpus_lib.BAD_FILE for c in CORPUS) >= 15
    assert len({c.name for c in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("group", GROUPS)
def test_skip_accounts_for_every_row_of_every_file(corpus_dir, tmp_path, group):
    """on_bad_file=skip: each file gives exactly its expected outcome, and valid + quarantined + duplicates
    equals the records counted from the bytes written (nothing lost), file by file."""
    cleaned, report = corpus_lib.run_group(corpus_dir, group, str(tmp_path), on_bad_file="skip")
    name = "scored.parquet" if group == "scored" else "preferences.parquet"
    got = corpus_lib.outcomes(str(tmp_path), name)
    cases = [c for c in CORPUS if c.group == group]
    for case in cases:
        uri = case.filename  # source_file: relative to the landing folder
        outcome = got.pop(uri, corpus_lib.ok(0))
        if case.expect == corpus_lib.BAD_FILE:
            assert outcome == corpus_lib.ok(0, bad_file=1), case.name  # and none of its rows half-written
            continue
        assert outcome == case.expect, case.name
        assert outcome["valid"] + sum(outcome["reasons"].values()) + outcome["duplicates"] == case.records, case.name
    assert not got  # no row from anywhere else
    assert report.invariant_holds and set(report.reasons) <= set(REASONS)
    quarantine = pq.read_table(tmp_path / "quarantine.parquet").to_pylist()
    assert all(q["detail"] and q["reason"] in REASONS for q in quarantine)
    for q in quarantine:
        if q["reason"] == "bad_file":  # file-level entry: line 0 and a cause a user can act on
            assert q["source_line"] == 0 and len(q["detail"]) > 20
        else:
            assert q["source_line"] >= 1 and q["raw"] is not None
    bad = {os.path.basename(b["uri"]) for b in report.extra["bad_files"]}
    assert bad == {c.filename for c in cases if c.expect == corpus_lib.BAD_FILE}


def test_fail_names_every_bad_file_and_writes_nothing(corpus_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BadInputFiles) as err:
        corpus_lib.run_group(corpus_dir, "preference", str(out))  # default on_bad_file=fail
    expected = {c.filename for c in CORPUS if c.group == "preference" and c.expect == corpus_lib.BAD_FILE}
    assert {os.path.basename(uri) for uri in err.value.bad} == expected
    message = str(err.value)
    assert all(name in message for name in expected) and "on_bad_file: skip" in message
    assert "truncated" in err.value.bad[os.path.join(corpus_dir, "preference", "gzip_truncated.jsonl.gz")]
    assert isinstance(err.value, IngestError)  # callers catching the contract error still catch it
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]  # no output, not even a temporary file


def _late_truncated_drop(folder) -> tuple[str, str]:
    os.makedirs(folder, exist_ok=True)
    good = os.path.join(folder, "a_good.jsonl")
    with open(good, "wb") as f:
        f.write(corpus_lib.jl(*corpus_lib.good(5)))
    late = os.path.join(folder, "b_late.jsonl.gz")
    with open(late, "wb") as f:
        f.write(corpus_lib.big_gzip_truncated())
    return good, late


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_truncation_found_mid_stream_leaves_no_half_written_rows(tmp_path, policy):
    """The cheap probe passes (the first 64 KB decompress); the fault shows after rows were read. Those
    rows must not reach the outputs: skip reruns the stage without the file, fail writes nothing."""
    good, late = _late_truncated_drop(tmp_path / "in")
    files = discover_inputs(str(tmp_path / "in"))
    with gzip.open(late) as f:  # rows before the truncation point exist and are readable
        assert f.read(1 << 16).count(b"\n") > 100
    cfg = IngestConfig(on_bad_file=policy, block_bytes=1 << 15)
    out = tmp_path / "out"
    if policy == "fail":
        with pytest.raises(BadInputFiles, match="b_late.jsonl.gz: compressed stream ends early"):
            clean_logs(files, str(out / "cleaned"), cfg)
        assert not [f for _, _, fs in os.walk(out) for f in fs]
        return
    cleaned = clean_logs(files, str(out / "cleaned"), cfg)
    rows = pq.read_table(cleaned.outputs["cleaned"]).column("source_file").to_pylist()
    assert rows == [os.path.basename(good)] * 5  # nothing of the truncated file; named relative to the landing
    quarantine = pq.read_table(cleaned.outputs["quarantine"]).to_pylist()
    assert [(q["source_file"], q["reason"], q["source_line"]) for q in quarantine] == [
        (os.path.basename(late), "bad_file", 0)]
    assert cleaned.extra["bad_files"][0]["uri"] == late and cleaned.invariant_holds
    # the one-pass path (clean + contract) takes the same way
    _, validated = ingest_logs(files, str(out / "onepass"), cfg, keep_cleaned=False)
    assert (validated.valid, validated.reasons) == (5, {"bad_file": 1})


def test_permission_denied_is_a_bad_file(tmp_path):
    """A file the process may not read: listed at discovery, a clear cause, skipped or fatal by policy.
    As root (CI), the check runs in a child without CAP_DAC_OVERRIDE (util-linux setpriv)."""
    good, _ = _late_truncated_drop(tmp_path / "in")
    os.remove(tmp_path / "in" / "b_late.jsonl.gz")
    locked = tmp_path / "in" / "c_locked.jsonl"
    locked.write_bytes(corpus_lib.jl(*corpus_lib.good(2)))
    locked.chmod(0)
    script = (
        "import json, sys\n"
        "from batchrl.ingest import IngestConfig, discover_inputs, clean_logs\n"
        "from batchrl.ingest.faults import BadInputFiles\n"
        "files = discover_inputs(sys.argv[1])\n"
        "try:\n"
        "    clean_logs(files, sys.argv[2] + '/fail', IngestConfig())\n"
        "    failed = None\n"
        "except BadInputFiles as e:\n"
        "    failed = e.bad\n"
        "report = clean_logs(files, sys.argv[2] + '/skip', IngestConfig(on_bad_file='skip'))\n"
        "print(json.dumps({'failed': failed, 'valid': report.valid, 'bad': report.extra['bad_files']}))\n"
    )
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without util-linux setpriv: cannot drop CAP_DAC_OVERRIDE")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(prefix + [sys.executable, "-c", script, str(tmp_path / "in"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    locked.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(result["failed"]) == [str(locked)] and "Permission denied" in result["failed"][str(locked)]
    assert result["valid"] == 5 and result["bad"][0]["uri"] == str(locked)


def test_unreadable_s3_objects(tmp_path, s3_options):
    """S3: an object that vanished after discovery and a truncated .gz object, through a real S3 API."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("drop-bad")
    fs.pipe("drop-bad/in/a.jsonl", corpus_lib.jl(*corpus_lib.good(3)))
    fs.pipe("drop-bad/in/b.jsonl", corpus_lib.jl(*corpus_lib.good(2)))
    whole = gzip.compress(corpus_lib.jl(*corpus_lib.good(30)), mtime=0)
    fs.pipe("drop-bad/in/c.jsonl.gz", whole[: len(whole) // 2])
    cfg = IngestConfig(storage_options=s3_options, on_bad_file="skip")
    files = discover_inputs("s3://drop-bad/in", s3_options)
    fs.rm("drop-bad/in/b.jsonl")  # removed between the manifest and the read
    _, report = ingest_logs(files, str(tmp_path / "out"), cfg, keep_cleaned=False)
    causes = {b["uri"].rsplit("/", 1)[-1]: b["cause"] for b in report.extra["bad_files"]}
    assert set(causes) == {"b.jsonl", "c.jsonl.gz"} and report.valid == 3
    assert "not found" in causes["b.jsonl"] and "truncated" in causes["c.jsonl.gz"]
    with pytest.raises(BadInputFiles, match="s3://drop-bad/in/b.jsonl"):
        ingest_logs(files, str(tmp_path / "fail"), cfg.model_copy(update={"on_bad_file": "fail"}))


def test_50mb_line_memory_is_bounded(tmp_path):
    """One 50 MB line: peak RSS of a child that ingests it, minus the same child on a tiny file, stays
    a small multiple of the line (the line is held a few times while parsed, cleaned, checked, written),
    not of the file or the block count. Takes ~5 s."""
    big = corpus_lib.jl(corpus_lib.row(0, prompt="w " * (corpus_lib.BIG_LINE_BYTES // 2)), corpus_lib.row(1))
    (tmp_path / "big").mkdir()
    (tmp_path / "small").mkdir()
    (tmp_path / "big" / "big.jsonl").write_bytes(big)
    (tmp_path / "small" / "small.jsonl").write_bytes(corpus_lib.jl(corpus_lib.row(2), corpus_lib.row(3)))
    script = (
        "import sys\n"
        "from batchrl.ingest import IngestConfig, discover_inputs, ingest_logs\n"
        "_, v = ingest_logs(discover_inputs(sys.argv[1]), sys.argv[2], IngestConfig(), keep_cleaned=False)\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"  # this process's
        "print(v.valid, v.quarantined, hwm)\n"  # peak (ru_maxrss would count the forking parent's RSS too)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    peaks = {}
    for name in ("small", "big"):
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / name), str(tmp_path / f"out-{name}")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        valid, quarantined, peak_kb = map(int, proc.stdout.split())
        assert (valid, quarantined) == (2, 0)
        peaks[name] = peak_kb * 1024
    growth = peaks["big"] - peaks["small"]
    print(f"50 MB line: peak RSS {peaks['big'] >> 20} MiB vs {peaks['small'] >> 20} MiB "
          f"(+{growth / len(big):.1f}x the line)")
    assert growth < 8 * len(big)
    out = pq.read_table(tmp_path / "out-big" / "preferences.parquet")
    assert len(out.column("prompt")[0].as_py()) == len("w " * (corpus_lib.BIG_LINE_BYTES // 2)) - 1  # trimmed


def test_corpus_script_writes_the_files(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "bad_inputs.py"), str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(written) == len(corpus_lib.cases(big_line=True)) > 40
