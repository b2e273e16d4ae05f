"""Data-plane benchmark: batchrl clean+validate+dedupe+Parquet vs raw DuckDB and a per-row Python loop.

    .venv/bin/python bench/bench_ingest.py                 # 1M rows (~650 MB JSONL), side by side, 3 rounds
    # contenders: batchrl (ingest_logs, one pass), batchrl_stages (cleaned_logs + validated_preferences as
    # the assets run), batchrl_duckdb (one pass, DuckDB block engine), duckdb (read_json -> parquet,
    # the ceiling), duckdb_sql (whole job in one SQL statement), python (per-row loop)
    .venv/bin/python bench/bench_ingest.py --rows 10000000 --only batchrl --repeat 1   # the 10x RSS check

Two times per run: ``process`` (the child process, interpreter start and imports included) and
``work`` (the contender's call alone, its modules imported before the clock starts).
Input: preference JSONL, ~200 chars per field, 1% bad rows (invalid JSON, undecodable bytes, empty /
whitespace-only / missing / extra / nested fields, chosen == rejected), 1% exact duplicates, some
control characters and non-ASCII text. Generated with DuckDB from a seeded word corpus (deterministic,
no per-row Python). Each contender runs in its own subprocess, one after the other, on the same file.
Peak RSS is the child's VmHWM (/proc, reset at exec). Files go under bench/out/ (gitignored) and are deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
BAD_MARK = "\u00a7BAD\u00a7"  # replaced by undecodable bytes after generation

GEN_SQL = """
WITH base AS (
  SELECT i, CASE WHEN i % 100 = 57 THEN i - 50 ELSE i END AS c  -- 1% duplicates of an earlier row
  FROM range({start}, {stop}) t(i)
), t AS (
  SELECT i, c,
    pieces[1 + (hash(c, 'p') % {span})::INT][1 + (hash(c, 'op') % 30)::INT : 170 + (hash(c, 'lp') % 60)::INT] AS p,
    pieces[1 + (hash(c, 'c') % {span})::INT][1 + (hash(c, 'oc') % 30)::INT : 170 + (hash(c, 'lc') % 60)::INT] AS ch,
    pieces[1 + (hash(c, 'r') % {span})::INT][1 + (hash(c, 'or') % 30)::INT : 170 + (hash(c, 'lr') % 60)::INT] AS rj,
    ['math', 'coding', 'writing', 'safety'][1 + (c % 4)::INT] AS cat
  FROM base, corpus_t
), shaped AS (
  SELECT i, CASE WHEN i % 100 = 13 THEN (i // 100) % 8 ELSE -1 END AS bad,
    CASE WHEN i % 50 = 3 THEN p || chr(7) || ' ' ELSE p END AS p, ch, rj, cat FROM t
)
SELECT CASE bad
  WHEN 0 THEN '{{"prompt": ' || to_json(p) || ', "chosen": ' || to_json(ch) || ', "rejected": '
  WHEN 1 THEN '{{"prompt": ' || to_json(p) || ', "chosen": "", "rejected": ' || to_json(rj) || '}}'
  WHEN 2 THEN '{{"prompt": ' || to_json(p) || ', "chosen": ' || to_json(ch) || ', "rejected": "   "}}'
  WHEN 3 THEN '{{"prompt": ' || to_json(p) || ', "chosen": ' || to_json(ch) || '}}'
  WHEN 4 THEN '{{"prompt": ' || to_json(p) || ', "chosen": ' || to_json(ch) || ', "rejected": ' || to_json(rj)
              || ', "debug_blob": "x"}}'
  WHEN 5 THEN '{{"prompt": ' || to_json(p) || ', "chosen": {{"text": ' || to_json(ch) || '}}, "rejected": '
              || to_json(rj) || '}}'
  WHEN 6 THEN '{{"prompt": ' || to_json(p) || ', "chosen": ' || to_json(ch) || ', "rejected": ' || to_json(ch) || '}}'
  WHEN 7 THEN '{{"prompt": "{bad}' || substr(p, 1, 20) || '", "chosen": ' || to_json(ch) || ', "rejected": '
              || to_json(rj) || '}}'
  ELSE '{{"id": "r' || i || '", "prompt": ' || to_json(p) || ', "chosen": ' || to_json(ch) || ', "rejected": '
       || to_json(rj) || ', "category": "' || cat || '"}}'
  END || chr(10) AS line
FROM shaped ORDER BY i
"""


def make_corpus(seed: int = 0, words: int = 400_000) -> str:
    rng = np.random.default_rng(seed)
    ascii_words = np.array(["the", "model", "answer", "question", "because", "data", "value", "function",
                            "returns", "list", "polite", "reply", "however", "therefore", "example", "code",
                            "python", "result", "first", "second", "then", "and", "x", "=", "42", "if", "not"])
    other = np.array(["café", "naïve", "über", "数据", "模型", "résumé", "cafe\u0301", "Ω"])
    picks = ascii_words[rng.integers(0, len(ascii_words), words)].astype(object)
    foreign = rng.random(words) < 0.004  # ~1 in 8 fields holds a non-ASCII word (English-dominant logs)
    picks[foreign] = other[rng.integers(0, len(other), int(foreign.sum()))]
    return " ".join(picks.tolist())


def generate(path: str, rows: int, seed: int = 0) -> int:
    """Write ``rows`` JSONL lines deterministically; returns bytes written. DuckDB builds the lines, the
    Arrow value buffer of each chunk is written as-is (no per-row Python)."""
    import duckdb
    import pyarrow as pa

    corpus = make_corpus(seed)
    con = duckdb.connect(config={"threads": 2})
    pieces = [corpus[k:k + 260] for k in range(0, len(corpus) - 260, 97)]  # overlapping windows
    con.execute("CREATE TABLE corpus_t AS SELECT ?::VARCHAR[] AS pieces", [pieces])
    span = len(pieces)
    written = 0
    with open(path + ".tmp", "wb") as f:
        step = 250_000
        for start in range(0, rows, step):
            sql = GEN_SQL.format(start=start, stop=min(rows, start + step), span=span, bad=BAD_MARK)
            col = con.sql(sql).to_arrow_table().column("line").combine_chunks()
            width = np.int64 if pa.types.is_large_string(col.type) else np.int32
            offsets = np.frombuffer(col.buffers()[1], width)[col.offset: col.offset + len(col) + 1]
            data = bytes(memoryview(col.buffers()[2])[offsets[0]:offsets[-1]])
            data = data.replace(BAD_MARK.encode(), b"\xff\xfe")
            f.write(data)
            written += len(data)
    os.replace(path + ".tmp", path)
    return written


# --- contenders (each runs in a child process) ---------------------------------------------------
def run_batchrl(src: str, out: str, engine: str = "auto") -> dict:
    """The data plane end to end in one pass (``ingest_logs``): clean + validate + dedupe + Parquet."""
    from batchrl.ingest import IngestConfig, discover_inputs, ingest_logs

    _, valid = ingest_logs(discover_inputs(src, hash_files=False), out, IngestConfig(engine=engine),
                           keep_cleaned=False)
    return {"validate": valid.to_metadata() | {"extra": None}}


def run_batchrl_stages(src: str, out: str) -> dict:
    """As the Dagster assets run: cleaned_logs (cleaned.parquet) then validated_preferences."""
    from batchrl.ingest import IngestConfig, clean_logs, discover_inputs, validate_preferences

    cfg = IngestConfig()
    cleaned = clean_logs(discover_inputs(src, hash_files=False), f"{out}/cleaned", cfg)
    valid = validate_preferences(f"{out}/cleaned", f"{out}/valid", cfg)
    return {"clean": cleaned.to_metadata() | {"extra": None}, "validate": valid.to_metadata() | {"extra": None},
            "stage_seconds": [round(cleaned.seconds, 2), round(valid.seconds, 2)]}


def run_batchrl_duckdb(src: str, out: str) -> dict:
    """One pass with the opt-in DuckDB block engine (IngestConfig.engine="duckdb")."""
    return run_batchrl(src, out, "duckdb")


def run_duckdb(src: str, out: str) -> dict:
    import duckdb

    os.makedirs(out, exist_ok=True)
    con = duckdb.connect(config={"threads": 2})
    con.execute(f"COPY (SELECT * FROM read_json('{src}', format='newline_delimited', ignore_errors=true, "
                f"columns={{id: 'VARCHAR', prompt: 'VARCHAR', chosen: 'VARCHAR', rejected: 'VARCHAR', "
                f"category: 'VARCHAR'}})) TO '{out}/duck.parquet' (FORMAT parquet, COMPRESSION zstd)")
    return {"rows_out": con.sql(f"SELECT count(*) FROM '{out}/duck.parquet'").fetchall()[0][0]}


SQL_CONTROL = r"[\x00-\x08\x0B-\x1F\x7F-\x{9F}]"  # RE2: C0 except \t \n, DEL, C1


def run_duckdb_sql(src: str, out: str) -> dict:
    """The whole job as one DuckDB SQL statement (what a full-SQL engine would cost): lines via read_csv,
    JSON classification (valid/object/keys/types), control-char regex, NFC, trim, contract checks, hash
    dedupe, COPY to Parquet. Approximate: no quarantine file or lineage, any duplicate kept (no input order)."""
    import duckdb

    os.makedirs(out, exist_ok=True)
    fields = ["prompt", "chosen", "rejected", "id", "category"]
    types = "[" + ", ".join(["'$'"] + [f"'$.{f}'" for f in fields]) + "]"
    paths = "[" + ", ".join(f"'$.{f}'" for f in fields) + "]"

    def clean(e: str) -> str:
        return f"trim(nfc_normalize(regexp_replace({e}, '{SQL_CONTROL}', '', 'g')), ' ' || chr(9) || chr(10))"

    sql = f"""COPY (
      WITH r AS (SELECT line FROM read_csv('{src}', columns={{'line': 'VARCHAR'}}, header=false, delim=chr(1),
                 quote='', escape='', new_line='\\n', ignore_errors=true, auto_detect=false)),
      p AS (SELECT line, CASE WHEN json_valid(line) THEN json_type(line, {types}) END AS t FROM r),
      k AS (SELECT line, t, CASE WHEN t[1] = 'OBJECT' THEN json_keys(line) END AS keys FROM p),
      v AS (SELECT json_extract_string(line, {paths}) AS v FROM k
            WHERE list_has_all({fields}, keys) AND len(keys) = len(list_distinct(keys))
              AND t[2] = 'VARCHAR' AND t[3] = 'VARCHAR' AND t[4] = 'VARCHAR'),
      c AS (SELECT v[4] AS id, {clean('v[1]')} AS prompt, {clean('v[2]')} AS chosen, {clean('v[3]')} AS rejected,
                   v[5] AS category FROM v)
      SELECT * FROM c WHERE prompt <> '' AND chosen <> '' AND rejected <> '' AND chosen <> rejected
      QUALIFY row_number() OVER (PARTITION BY hash(prompt, chosen, rejected)) = 1
    ) TO '{out}/prefs.parquet' (FORMAT parquet, COMPRESSION snappy)"""
    con = duckdb.connect(config={"threads": 2})
    con.execute(sql)
    return {"rows_out": con.sql(f"SELECT count(*) FROM '{out}/prefs.parquet'").fetchall()[0][0]}


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def run_python(src: str, out: str) -> dict:
    """The per-row loop a data script would write: json.loads, regex clean, validate, dedupe, json.dumps."""
    import hashlib
    import unicodedata

    os.makedirs(out, exist_ok=True)
    seen, valid, bad, dup = set(), 0, 0, 0
    with open(src, "rb") as f, open(f"{out}/clean.jsonl", "w", encoding="utf-8") as w:
        for raw in f:
            try:
                row = json.loads(raw.decode("utf-8").lstrip("\ufeff"))
                if set(row) - {"id", "prompt", "chosen", "rejected", "category"}:
                    raise ValueError("extra")
                for k in ("prompt", "chosen", "rejected"):
                    v = row[k]
                    if not isinstance(v, str):
                        raise ValueError("type")
                    row[k] = unicodedata.normalize("NFC", CONTROL.sub("", v)).strip()
                    if not row[k]:
                        raise ValueError("empty")
                if row["chosen"] == row["rejected"]:
                    raise ValueError("equal")
            except (ValueError, KeyError, UnicodeDecodeError):
                bad += 1
                continue
            key = hashlib.blake2b("\x1f".join((row["prompt"], row["chosen"], row["rejected"])).encode(),
                                  digest_size=16).digest()
            if key in seen:
                dup += 1
                continue
            seen.add(key)
            valid += 1
            w.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {"valid": valid, "bad": bad, "duplicates": dup}


CONTENDERS = {"batchrl": run_batchrl, "batchrl_stages": run_batchrl_stages, "batchrl_duckdb": run_batchrl_duckdb,
              "duckdb": run_duckdb, "duckdb_sql": run_duckdb_sql, "python": run_python}
OURS = ("batchrl", "batchrl_stages", "batchrl_duckdb")
PRELOAD = {"batchrl": "batchrl.ingest", "batchrl_stages": "batchrl.ingest", "batchrl_duckdb": "batchrl.ingest",
           "duckdb": "duckdb", "duckdb_sql": "duckdb", "python": "unicodedata"}


def _sample_rss(trace: list) -> None:
    while True:
        with open("/proc/self/status") as f:
            trace.append(round(int(next(l for l in f if l.startswith("VmRSS")).split()[1]) / 1024, 1))
        time.sleep(0.5)


def measure(name: str, src: str) -> dict:
    out = os.path.join(OUT, f"run_{name}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", name, "--src", src, "--out", out]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    result = json.loads(proc.stdout.read())
    size = os.path.getsize(src) / 1e6
    shutil.rmtree(out, ignore_errors=True)
    work = result.pop("work_seconds")
    trace = result.pop("rss_trace_mb")
    tenth = trace[: max(1, len(trace) // 10)]
    return {"name": name, "seconds": round(seconds, 2), "mb_s": round(size / seconds, 1),
            "work_seconds": work, "work_mb_s": round(size / work, 1), "peak_rss_mb": result.pop("vm_hwm_mb"),
            "rss_first_tenth_max_mb": max(tenth), "rss_last_tenth_max_mb": max(trace[-len(tenth):]),
            "exit": status, "result": result}


def median_run(runs: list[dict]) -> dict:
    """The run with the median process time (odd counts) or the slower middle one; all times listed."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["all_seconds"] = [r["seconds"] for r in runs]
    chosen["all_work_seconds"] = [r["work_seconds"] for r in runs]
    chosen["max_peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--only", default="batchrl,batchrl_stages,duckdb,duckdb_sql,python")
    ap.add_argument("--repeat", type=int, default=3, help="runs per contender, interleaved; the median is kept")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--src")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child == "generate":
        generate(args.src, args.rows)
        return
    if args.child:
        importlib.import_module(PRELOAD[args.child])  # so work_seconds is the work, not the imports
        trace: list[float] = []
        threading.Thread(target=_sample_rss, args=(trace,), daemon=True).start()
        start = time.perf_counter()
        result = CONTENDERS[args.child](args.src, args.out)
        result["work_seconds"] = round(time.perf_counter() - start, 3)
        result["rss_trace_mb"] = trace  # VmRSS every 0.5 s of the work: flat or growing?
        with open("/proc/self/status") as f:  # VmHWM: this process image's peak RSS (reset at exec)
            result["vm_hwm_mb"] = round(int(next(l for l in f if l.startswith("VmHWM")).split()[1]) / 1024, 1)
        print(json.dumps(result))
        return
    os.makedirs(OUT, exist_ok=True)
    src = os.path.join(OUT, f"prefs_{args.rows}.jsonl")
    t0 = time.perf_counter()
    if not os.path.exists(src):  # in a child, so this process stays small
        subprocess.run([sys.executable, __file__, "--child", "generate", "--src", src, "--rows", str(args.rows)],
                       check=True)
    gen = time.perf_counter() - t0
    size = os.path.getsize(src)
    print(f"input {src}: {args.rows} rows, {size / 1e6:.0f} MB, generated in {gen:.1f}s", flush=True)
    names = args.only.split(",")
    runs: dict[str, list] = {name: [] for name in names}
    for _ in range(args.repeat):  # interleaved, so a noisy minute does not hit one contender only
        for name in names:
            r = measure(name, src)
            runs[name].append(r)
            print(f"{name:15s} process {r['seconds']:7.2f}s {r['mb_s']:6.1f} MB/s | work {r['work_seconds']:7.2f}s "
                  f"{r['work_mb_s']:6.1f} MB/s | peak RSS {r['peak_rss_mb']:7.1f} MB (VmRSS max in the first / "
                  f"last tenth of the work: {r['rss_first_tenth_max_mb']} / {r['rss_last_tenth_max_mb']} MB)",
                  flush=True)
    results = {name: median_run(rs) for name, rs in runs.items()}
    print("medians:")
    for name, r in results.items():
        print(f"{name:15s} process {r['seconds']:7.2f}s {r['mb_s']:6.1f} MB/s | work {r['work_seconds']:7.2f}s "
              f"{r['work_mb_s']:6.1f} MB/s | peak RSS (max) {r['max_peak_rss_mb']:7.1f} MB")
    for ours in OURS:
        for other in ("duckdb", "duckdb_sql", "python"):
            if ours in results and other in results:
                print(f"{ours} / {other}: process {results[ours]['mb_s'] / results[other]['mb_s']:.2f}x, "
                      f"work {results[ours]['work_mb_s'] / results[other]['work_mb_s']:.2f}x")
    for name, r in results.items():
        print(name, json.dumps(r["result"]))
    if not args.keep:
        os.unlink(src)


if __name__ == "__main__":
    main()
