"""DuckDB-vectorised JSONL block engine (``IngestConfig.engine = "duckdb"``; opt-in, see below).

Same blocks, same answers as ``JsonlReader``; only the per-block work moves into DuckDB (vectorised,
multi-threaded C++ instead of the Arrow JSON parser plus its error isolation):

1. numpy finds the lines of the block; one UTF-8 check of the whole block (halving only on failure);
   the lines become one Arrow string column without copying (offsets into the block buffer).
2. One SQL query per block: strip one leading BOM and trailing ``\\r``, then ``json_type`` /
   ``json_keys`` / ``json_extract_string`` with path lists (one parse each) decide whether a line is
   *plain*: a JSON object whose keys are contract + metadata (+ ``drop_fields``) fields, required text
   fields are strings, metadata strings or null, score a finite number, no duplicate keys and no
   trailing comma (DuckDB accepts ``{"a": 1,}``, Python does not).
3. Plain lines are returned as contract columns; every other non-blank line (invalid JSON or UTF-8,
   wrong keys/types, nested values, ...) goes through the per-line reference path
   (``json.loads`` + ``RecordStructurer``), so reason codes and details come from one place.

Cleaning (``clean_table``), the pandera contract (run by ``ContractValidator`` on every batch, as on
the Arrow path), dedupe and the Parquet sinks are unchanged, so the outputs are byte-identical to the
Arrow path (tested). Used only where it is exact: no ``field_mapping``, no ``chat_mapping``,
``fast_json=True`` (see ``duckdb_applies``).

Why it is not the default ("auto" picks the Arrow engine): each DuckDB JSON function re-parses the
line (valid + types + keys + values = 4 parses), so a block costs ~2-3x the CPU of one
``pyarrow.json`` parse; on 2 cores the end-to-end run was 0.93x the Arrow engine (bench/RESULTS.md).
"""
from __future__ import annotations

import threading

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.ingest.config import IngestConfig
from batchrl.ingest.discover import InputFile
from batchrl.ingest.jsonl import JsonlReader, _Block, split_lines
from batchrl.ingest.shapes import flat_shape
from batchrl.ingest.textclean import CANDIDATE_COLUMN
from batchrl.schemas import ARROW_SCHEMAS

_BOM = np.frombuffer(b"\xef\xbb\xbf", np.uint8)
_ESCAPES = np.frombuffer(b"bfru", np.uint8)


def _line_of(starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, positions, side="right") - 1


def control_candidates(buf: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Lines of a *valid-JSON-for-DuckDB* block that may hold a control character once decoded: an
    escape ``\\b \\f \\r \\u...`` (superset of the C0/DEL/C1 escapes), raw DEL or a UTF-8 C1 (C2 80..9F).
    Raw C0 bytes are not looked for: DuckDB rejects them inside strings, so those lines take the reference
    path, whose rows are all candidates."""
    flags = np.zeros(len(starts), bool)
    padded = np.concatenate((buf, np.zeros(1, np.uint8)))
    back = np.flatnonzero(buf == 92)
    flags[_line_of(starts, back[np.isin(padded[back + 1], _ESCAPES)])] = True
    c2 = np.flatnonzero(buf == 0xC2)
    flags[_line_of(starts, c2[(padded[c2 + 1] >= 0x80) & (padded[c2 + 1] <= 0x9F)])] = True
    flags[_line_of(starts, np.flatnonzero(buf == 127))] = True
    return flags


def duckdb_applies(cfg: IngestConfig) -> bool:
    """The DuckDB reader is exact only for flat records without renames (else: the Arrow path)."""
    if cfg.engine != "duckdb" or not cfg.fast_json:
        return False
    return not cfg.field_mapping and flat_shape(cfg)


def _sql_list(items) -> str:
    return "[" + ", ".join("'" + s.replace("'", "''") + "'" for s in items) + "]"


class DuckJsonlReader(JsonlReader):
    def __init__(self, file: InputFile, cfg: IngestConfig, extras=None):
        super().__init__(file, cfg, extras)
        # blocks already run in cfg.threads workers: one DuckDB thread each avoids oversubscription
        self.con = duckdb.connect(config={"threads": 1 if cfg.threads > 1 else 2})
        self.local = threading.local()
        fields = list(cfg.required) + list(cfg.metadata)
        allowed = sorted(set(fields) | set(cfg.drop_fields))
        paths = _sql_list(["$"] + [f'$."{f}"' for f in fields])
        checks = ["v IS NOT NULL"]  # an object with allowed, distinct keys
        for k, name in enumerate(fields, start=2):
            if name == "score":
                checks.append(f"t[{k}] IN ('BIGINT', 'DOUBLE') AND isfinite(TRY_CAST(v[{k - 1}] AS DOUBLE))")
            elif name in cfg.required:
                checks.append(f"t[{k}] = 'VARCHAR'")
            else:
                checks.append(f"coalesce(t[{k}], 'NULL') IN ('VARCHAR', 'NULL')")
        cols = [f"TRY_CAST(v[{k}] AS DOUBLE) AS score" if name == "score" else f'v[{k}] AS "{name}"'
                for k, name in enumerate(fields, start=1)]
        self.sql = f"""
        WITH p AS (
          SELECT i, line, CASE WHEN json_valid(line) THEN json_type(line, {paths}) END AS t FROM blk WHERE keep
        ), k AS (
          SELECT i, line, t, CASE WHEN t[1] = 'OBJECT' THEN json_keys(line) END AS keys FROM p
        ), c AS (
          SELECT i, line, t, keys,
                 CASE WHEN t[1] = 'OBJECT' AND list_has_all({_sql_list(allowed)}, keys)
                      AND len(keys) = len(list_distinct(keys))
                 THEN json_extract_string(line, {_sql_list([f'$."{f}"' for f in fields])}) END AS v
          FROM k
        )
        SELECT i, coalesce({' AND '.join(checks)} AND NOT regexp_matches(line, ',\\s*[}}\\]]'), false) AS plain,
               {', '.join(cols)}
        FROM c ORDER BY i
        """

    def _cursor(self):
        cur = getattr(self.local, "cur", None)
        if cur is None:
            cur = self.local.cur = self.con.cursor()
        return cur

    def _block(self, block: bytes, line_base: int, offset_base: int):
        buf, starts, ends, blank = split_lines(block)
        lengths = ends - starts
        ctx = _Block(block, starts, ends, line_base, offset_base)
        rows = np.flatnonzero(~blank)
        bad = rows[self._invalid_utf8_rows(ctx, rows)]
        head = buf[np.minimum(starts[:, None] + np.arange(3), len(block) - 1)]
        bom = np.flatnonzero((lengths >= 3) & (head == _BOM).all(axis=1))  # rare: reference path
        bad = np.union1d(bad, bom)
        data = block
        if len(bad):  # blank out undecodable lines (the reference path reads them from ``ctx``)
            data = bytearray(block)
            for i in bad:
                data[starts[i]:ends[i]] = b" " * int(ends[i] - starts[i])
            blank = blank.copy()
            blank[bad] = True
        offsets = np.append(starts, len(block)).astype(np.int64)
        lines = pa.LargeStringArray.from_buffers(len(starts), pa.py_buffer(offsets), pa.py_buffer(data))
        blk = pa.table({"i": pa.array(np.arange(len(starts)), pa.int64()), "line": lines, "keep": pa.array(~blank)})
        cur = self._cursor()
        cur.register("blk", blk)
        try:
            out = cur.sql(self.sql).to_arrow_table()
        finally:
            cur.unregister("blk")
        plain = out.column("plain").to_numpy(zero_copy_only=False)
        idx = out.column("i").to_numpy()
        slow_rows = np.sort(np.concatenate((bad, idx[~plain])))
        good, rejects = self._slow(ctx, slow_rows)
        fast = out.filter(pa.array(plain))
        schema = ARROW_SCHEMAS[self.cfg.kind]
        n = fast.num_rows
        cols = {}
        for f in schema:
            if f.name == "source_file":
                cols[f.name] = pa.repeat(pa.scalar(self.file.source, f.type), n)
            elif f.name == "source_line":
                cols[f.name] = pc.add(fast.column("i"), line_base + 1)
            elif f.name in ("extra", "prompt_messages"):  # lines with extra fields / messages are not plain
                cols[f.name] = pa.nulls(n, f.type)
            else:
                cols[f.name] = fast.column(f.name).cast(f.type)
        table = pa.table(cols, schema=schema)
        control = control_candidates(buf, starts)[fast.column("i").to_numpy()]
        if good.num_rows:  # reference rows: every one is a control-character candidate
            control = np.concatenate((control, np.ones(good.num_rows, bool)))
            table = pa.concat_tables([table, good])
            order = pc.sort_indices(table.column("source_line"))
            table = table.take(order)
            control = control[order.to_numpy()]
        table = table.append_column(CANDIDATE_COLUMN, pa.array(control))
        step = self.cfg.batch_rows
        for i in range(0, max(table.num_rows, 1), step):
            yield table.slice(i, step), (rejects if i == 0 else [])

