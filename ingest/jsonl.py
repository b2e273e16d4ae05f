"""Streaming JSONL reader: large byte blocks, one vectorised parse each, per-line fallback only where needed.

A block (``block_bytes``, cut at a newline) is checked by Arrow's UTF-8 validator and screened with
numpy (lines that are not ``{...}``, nested values, raw control bytes, bad UTF-8). Those lines are
overwritten in place by ``{}`` + spaces (their original bytes are kept) and the whole block is parsed
by ``pyarrow.json`` with the contract's explicit schema, once. The masked lines, and rows the fast
path cannot judge exactly (nulls, extra fields), go through the per-line reference path (``json.loads``
+ ``RecordStructurer``), so reason codes come from one place. A parse error the screen missed marks
that line and the block is parsed again (a few times; then contiguous runs are parsed one by one with
the error isolated). Blank lines are skipped and not counted as rows.
"""
from __future__ import annotations

import json
import re
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from batchrl.ingest.config import IngestConfig, IngestError
from batchrl.ingest.discover import InputFile, open_binary
from batchrl.ingest.textclean import CANDIDATE_COLUMN
from batchrl.ingest.shapes import flat_shape
from batchrl.ingest.records import (
    EXTRA_JSON_COLUMN, ExtraFieldCounter, RecordStructurer, Reject, RowError, extra_json_column, raw_text,
    rows_to_table, structure_table,
)

BOM = b"\xef\xbb\xbf"

_ESCAPE_HIGH_NIBBLES = np.frombuffer(b"01789", np.uint8)
_ROW_RE = re.compile(r"in row (\d+)")
_STRING_INDEX_RE = re.compile(r"at string index (\d+)")


def _read_into(stream, view: memoryview) -> int:
    """Fill ``view`` from ``stream`` (several reads if the stream returns short); bytes read."""
    total = 0
    while total < len(view):
        n = stream.readinto(view[total:]) if hasattr(stream, "readinto") else None
        if n is None:  # no readinto: read + copy
            data = stream.read(len(view) - total)
            n = len(data)
            view[total:total + n] = data
        if not n:
            break
        total += n
    return total


def split_lines(block: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bytes as uint8, line starts, line ends without the newline, blank: empty or a lone ``\\r``)."""
    buf = np.frombuffer(block, dtype=np.uint8)
    newlines = np.flatnonzero(buf == 10)
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [len(block)]))
    if block.endswith(b"\n"):
        starts, ends = starts[:-1], ends[:-1]
    lengths = ends - starts
    blank = (lengths == 0) | ((lengths == 1) & (buf[np.minimum(starts, len(block) - 1)] == 13))
    return buf, starts, ends, blank


class JsonlReader:
    def __init__(self, file: InputFile, cfg: IngestConfig, extras: ExtraFieldCounter | None = None):
        self.file, self.cfg = file, cfg
        self.extras = extras if extras is not None else ExtraFieldCounter()
        self.structurer = RecordStructurer(cfg, self.extras)
        self.fast = cfg.fast_json and flat_shape(cfg)
        source = {dst: src for src, dst in cfg.field_mapping.items()}
        fields = []
        for name in cfg.required + cfg.metadata:
            fields.append(pa.field(source.get(name, name), pa.float64() if name == "score" else pa.string()))
        self.parse_schema = pa.schema(fields)
        self.first_checked = False
        self.digest = None  # a hashlib object: sees the file's stored bytes as ``blocks`` reads them

    # -- block iteration ---------------------------------------------------------------------
    def batches(self) -> Iterator[tuple[pa.Table, list[Reject]]]:
        for block in self.blocks():
            yield from self.process(*block)

    def blocks(self) -> Iterator[tuple[bytes, int, int]]:
        """(block, line number before it, byte offset) — sequential I/O; ``process`` may run in threads."""
        line_base, offset_base, carry = 0, 0, b""
        with open_binary(self.file, self.cfg.storage_options, self.digest) as stream:
            while True:
                block = bytearray(len(carry) + self.cfg.block_bytes)  # read straight into it (no GIL)
                block[:len(carry)] = carry
                got = _read_into(stream, memoryview(block)[len(carry):])
                del block[len(carry) + got:]
                carry = b""
                if got:  # keep the unfinished last line for the next block
                    cut = block.rfind(b"\n")
                    if cut < 0:
                        carry = bytes(block)
                        continue
                    carry = bytes(block[cut + 1:])
                    del block[cut + 1:]
                if block:
                    if not self.first_checked:
                        self._check_first_in(block, line_base)
                    # counted before a worker gets the block (it masks lines in place; newlines stay)
                    newlines = np.count_nonzero(np.frombuffer(block, np.uint8) == 10)  # numpy: no GIL
                    yield block, line_base, offset_base
                    line_base += newlines + (0 if block.endswith(b"\n") else 1)
                    offset_base += len(block)
                if not got:
                    break

    def _check_first_in(self, block: bytes, line_base: int) -> None:
        for k, line in enumerate(block.split(b"\n")):
            if line.strip():
                self._check_first_record(line.rstrip(b"\r"), line_base + k + 1)
                return

    def process(self, block: bytes, line_base: int, offset_base: int) -> list[tuple[pa.Table, list[Reject]]]:
        return list(self._block(block, line_base, offset_base))

    def _block(self, block: bytes, line_base: int, offset_base: int):
        buf, starts, ends, blank = split_lines(block)
        rows = np.flatnonzero(~blank)  # indices of non-blank lines within the block
        ctx = _Block(block, starts, ends, line_base, offset_base)
        if not self.fast:
            good, rejects = self._slow(ctx, rows)
            fast_tables = []
        else:
            suspicious, control = self._screen(ctx, buf)
            fast_tables, slow_rows = self._fast(ctx, rows, suspicious)
            good, rejects = self._slow(ctx, slow_rows)
        tables = [t for t in fast_tables if t.num_rows] + ([good] if good.num_rows else [])
        if not tables:
            table = rows_to_table([], [], self.file.source, self.cfg.kind)
        elif len(tables) == 1:
            table = tables[0]
        else:
            table = pa.concat_tables(tables)
            table = table.take(pc.sort_indices(table.column("source_line")))
        if not self.fast:
            control = np.ones(len(starts), bool)
        table = table.append_column(CANDIDATE_COLUMN, pa.array(control[table.column("source_line").to_numpy()
                                                                        - line_base - 1]))
        step = self.cfg.batch_rows
        for i in range(0, max(table.num_rows, 1), step):
            yield table.slice(i, step), (rejects if i == 0 else [])

    def _check_first_record(self, line: bytes, line_no: int) -> None:
        self.first_checked = True
        try:
            obj = json.loads(line.removeprefix(BOM).decode("utf-8"), strict=False)
        except (ValueError, RecursionError):
            return  # an undecodable/invalid first line is quarantined like any other
        if isinstance(obj, dict):
            missing, extra = self.structurer.check_keys(obj)
            if missing or extra:
                raise IngestError(self.file.uri, line_no, "first record does not match the contract",
                                  missing, extra)

    # -- fast path ---------------------------------------------------------------------------
    @staticmethod
    def _screen(ctx: "_Block", buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Byte-level screen of the block (numpy compares, sparse hits) -> per line (suspicious, control).

        suspicious: lines the Arrow parser would stop at go straight to the reference path instead of
        costing a failed parse: not ``{...}`` (truncated, arrays, BOM), raw control bytes, an object or
        array as a value (``:{`` / ``:[``). False positives only cost speed; misses are caught by the
        parse-error isolation. control: lines that may hold control characters once decoded (escapes
        ``\\u00XX`` for C0/DEL/C1, ``\\b \\f \\r``, raw C0/DEL, UTF-8 C1); only those rows pay for the
        control-character regex."""
        n = len(ctx.starts)
        suspicious, control = np.zeros(n, bool), np.zeros(n, bool)
        if n == 0:
            return suspicious, control
        ends = np.maximum(ctx.ends - 1, ctx.starts)
        last = buf[ends]
        last = np.where((last == 13) & (ends > ctx.starts), buf[np.maximum(ends - 1, 0)], last)
        suspicious |= (buf[np.minimum(ctx.starts, len(buf) - 1)] != 123) | (last != 125)
        block = ctx.block

        def mark(flags: np.ndarray, positions) -> None:
            if len(positions):
                flags[np.searchsorted(ctx.starts, np.asarray(positions), side="right") - 1] = True

        n_lines = len(ctx.starts)  # raw control bytes: only when there are more than \n \t \r
        low = np.count_nonzero(buf < 32)
        if low > n_lines and low > n_lines + np.count_nonzero(buf == 9) + np.count_nonzero(buf == 13):
            raw = np.flatnonzero((buf < 32) & (buf != 10) & (buf != 9) & (buf != 13))
            mark(suspicious, raw)
            mark(control, raw)
        last_index = len(buf) - 1
        colon = np.flatnonzero(buf == 58)  # ":{" ":[" ": {" ": [" -> an object/array value
        nxt, nxt2 = buf[np.minimum(colon + 1, last_index)], buf[np.minimum(colon + 2, last_index)]
        mark(suspicious, colon[(nxt == 123) | (nxt == 91) | ((nxt == 32) & ((nxt2 == 123) | (nxt2 == 91)))])
        back = np.flatnonzero(buf == 92)  # \b \f \r \u000X \u001X \u007F \u008X \u009X
        nxt, nxt2, nxt3, nxt4 = (buf[np.minimum(back + k, last_index)] for k in (1, 2, 3, 4))
        escape = (nxt == 98) | (nxt == 102) | (nxt == 114) | (
            (nxt == 117) & (nxt2 == 48) & (nxt3 == 48) & np.isin(nxt4, _ESCAPE_HIGH_NIBBLES))
        mark(control, back[escape])
        if block.find(b"\xc2") >= 0:  # UTF-8 C1 controls C2 80..C2 9F; memchr first: usually absent
            c2 = np.flatnonzero(buf == 0xC2)
            after = buf[np.minimum(c2 + 1, last_index)]
            mark(control, c2[(after >= 0x80) & (after <= 0x9F)])
        if block.find(b"\x7f") >= 0:
            mark(control, np.flatnonzero(buf == 127))
        return suspicious, control

    def _fast(self, ctx: "_Block", rows: np.ndarray, suspicious: np.ndarray) -> tuple[list[pa.Table], list[int]]:
        """-> (structured tables, lines for the reference path). ``rows``: the non-blank lines."""
        suspicious = suspicious.copy()
        suspicious[rows[self._invalid_utf8_rows(ctx, rows)]] = True
        parsed = self._parse_masked(ctx, rows, suspicious)
        if parsed is not None:
            tables, slow = [parsed[0]], parsed[1]
        else:  # contiguous runs of plain lines, each parsed on its own, errors isolated
            tables, slow = [], rows[suspicious[rows]].tolist()
            plain = rows[~suspicious[rows]]
            for run in np.split(plain, np.flatnonzero(np.diff(plain) != 1) + 1):
                self._isolate(ctx, run, tables, slow)
        tables = [(t, seg) for t, seg in tables if len(seg)]
        if not tables:
            return [], sorted(set(slow))
        parsed_table = pa.concat_tables([t for t, _ in tables])
        lines = ctx.line_base + np.concatenate([seg for _, seg in tables]) + 1
        structured, rejects = structure_table(parsed_table, lines, self.cfg, self.file.source, lambda i: "",
                                              extras=self.extras)
        assert not rejects, rejects  # the explicit schema guarantees flat, typed, non-null values
        return [structured], sorted(set(slow))

    def _parse_masked(self, ctx: "_Block", rows: np.ndarray, suspicious: np.ndarray):
        """One parse of the whole block with every suspicious line overwritten by ``{}`` and spaces (an
        empty object keeps the row numbering), so a dirty line costs a byte copy, not a parser restart.
        A parse error at row r sends lines r-1 and r to the reference path and parses again (a few times).
        Returns ((table, its lines), lines for the reference path) or None (use the runs path)."""
        for _ in range(4):
            slow_rows = rows[suspicious[rows]]
            lengths = ctx.ends[slow_rows] - ctx.starts[slow_rows]
            if (lengths < 2).any():
                return None
            for i, start, n in zip(slow_rows.tolist(), ctx.starts[slow_rows].tolist(), lengths.tolist()):
                if i not in ctx.originals:  # masked in place; the reference path reads the original
                    ctx.originals[i] = bytes(ctx.block[start:start + n])
                    ctx.block[start:start + n] = b"{}" + b" " * (n - 2)
            try:
                table = self._read(memoryview(ctx.block))
            except pa.ArrowInvalid as e:
                m = _ROW_RE.search(str(e))
                r = int(m.group(1)) if m else -1
                if not 0 <= r < len(rows):
                    return None
                suspicious[rows[max(r - 1, 0):r + 1]] = True
                continue
            if table.num_rows != len(rows):  # whitespace-only lines: let the runs path decide
                return None
            slow: list[int] = []  # the masked lines are all-null rows: _defer sends them back to slow
            return self._defer(table, rows, slow), slow
        return None

    def _isolate(self, ctx: "_Block", seg: np.ndarray, tables: list, slow: list) -> None:
        """Parse ``seg``; on an error at row r, keep the rows before it, send r (and r-1: an unterminated
        line swallows the newline, so the parser reports the line after it) to the reference path."""
        while len(seg):
            try:
                tables.append(self._parse_segment(ctx, seg, slow))
                return
            except pa.ArrowInvalid as e:
                m = _ROW_RE.search(str(e))
                r = int(m.group(1)) if m else -1
                if r < 0 or r >= len(seg) or len(seg) == 1:
                    slow.extend(seg.tolist())
                    return
                first_bad = max(r - 1, 0)
                self._isolate(ctx, seg[:first_bad], tables, slow)
                slow.extend(seg[first_bad:r + 1].tolist())
                seg = seg[r + 1:]

    def _invalid_utf8_rows(self, ctx: "_Block", rows: np.ndarray) -> np.ndarray:
        """Positions in ``rows`` of lines that are not UTF-8. One Arrow UTF-8 validation of the whole
        block (GB/s); only if it fails, the lines become one string array over the same buffer (no copy)
        whose validation names the first bad line; it resumes after it: one call per bad line."""
        buffer = pa.py_buffer(ctx.block)
        if _utf8_valid(buffer, 0, len(ctx.block)):
            return np.zeros(0, np.int64)
        offsets = pa.py_buffer(np.append(ctx.starts[rows], len(ctx.block)).astype(np.int64))
        lines = pa.Array.from_buffers(pa.large_string(), len(rows), [None, offsets, buffer])
        bad: list[int] = []
        position = 0
        while position < len(rows):
            try:
                lines.slice(position).validate(full=True)
                break
            except pa.ArrowInvalid as e:
                found = _STRING_INDEX_RE.search(str(e))
                if found is None:  # unknown message: fall back to one line at a time
                    return np.array([i for i in range(len(rows)) if not _utf8_valid(
                        buffer, int(ctx.starts[rows[i]]), int(ctx.ends[rows[i]]))], np.int64)
                bad.append(position + int(found.group(1)))
                position = bad[-1] + 1
        return np.array(bad, np.int64)

    def _read(self, data) -> pa.Table:
        return pajson.read_json(
            pa.BufferReader(pa.py_buffer(data)),
            read_options=pajson.ReadOptions(use_threads=False, block_size=max(len(data) + 1, 1 << 16)),
            parse_options=pajson.ParseOptions(explicit_schema=self.parse_schema, unexpected_field_behavior="infer"),
        )

    def _parse_segment(self, ctx: "_Block", seg: np.ndarray, slow: list[int]) -> tuple[pa.Table, np.ndarray]:
        start, end = ctx.starts[seg[0]], ctx.ends[seg[-1]]
        table = self._read(memoryview(ctx.block)[start:end])
        if table.num_rows != len(seg):  # whitespace-only lines: let the reference path decide
            raise pa.ArrowInvalid("row count mismatch")
        return self._defer(table, seg, slow)

    def _defer(self, table: pa.Table, seg: np.ndarray, slow: list[int]) -> tuple[pa.Table, np.ndarray]:
        """Rows the fast path cannot judge exactly go to ``slow``: a null required field; with
        ``extra_fields`` quarantine/error any extra field; with keep an extra field whose inferred type may
        not be the JSON value (numbers that may have been ints, timestamps, nested values). Under keep the
        other extra fields become the ``EXTRA_JSON_COLUMN``; under drop they are counted and dropped."""
        known = set(self.parse_schema.names)
        extras = [c for c in table.column_names if c not in known and c not in self.cfg.drop_fields]
        required_src = [self.parse_schema.field(i).name for i in range(len(self.cfg.required))]
        policy = self.cfg.extra_fields
        defer = np.zeros(table.num_rows, bool)
        for c in required_src:
            if table.column(c).null_count:
                defer |= table.column(c).is_null().to_numpy(zero_copy_only=False)
        exact = [c for c in extras if policy == "drop" or _json_exact(table.column(c).type)]
        for c in extras:
            if policy in ("quarantine", "error") or c not in exact:
                defer |= table.column(c).is_valid().to_numpy(zero_copy_only=False)
        if defer.any():
            slow.extend(seg[defer].tolist())
            table = table.filter(pa.array(~defer))
            seg = seg[~defer]
        if exact and policy in ("keep", "drop"):
            self.extras.add({c: n for c in exact if (n := len(table) - table.column(c).null_count)})
        out = table.select(self.parse_schema.names)
        if policy == "keep":
            with_extras = [c for c in exact if table.column(c).null_count < len(table)]
            column = extra_json_column(table.select(with_extras)) if with_extras else pa.nulls(len(table), pa.string())
            out = out.append_column(EXTRA_JSON_COLUMN, column)
        return out, seg

    # -- reference path ----------------------------------------------------------------------
    def _slow(self, ctx: "_Block", rows) -> tuple[pa.Table, list[Reject]]:
        good, good_lines, rejects = [], [], []
        for i in rows:
            raw = ctx.line(i)
            line_no = ctx.line_base + int(i) + 1
            body = raw.removeprefix(BOM)
            try:
                try:
                    text = body.decode("utf-8")
                except UnicodeDecodeError as e:
                    offset = ctx.offset_base + int(ctx.starts[i]) + (len(raw) - len(body)) + e.start
                    raise RowError("undecodable", f"invalid UTF-8 byte 0x{body[e.start]:02x} at byte offset "
                                                  f"{offset} (line {line_no}, column {e.start + 1})")
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text, strict=False)
                except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
                    raise RowError("invalid_json", str(e))
                good.append(self.structurer(obj))
                good_lines.append(line_no)
            except RowError as e:
                rejects.append(Reject(e.reason, e.detail, line_no, raw_text(raw)))
        return rows_to_table(good, good_lines, self.file.source, self.cfg.kind), rejects


def _json_exact(t: pa.DataType) -> bool:
    """Arrow types inferred from JSON whose Python value is exactly what ``json.loads`` gives (an int64
    column held only integers; a double one may have held ``1`` as well as ``1.5``)."""
    return pa.types.is_string(t) or pa.types.is_int64(t) or pa.types.is_boolean(t) or pa.types.is_null(t)


def _utf8_valid(buffer: pa.Buffer, start: int, end: int) -> bool:
    """Is ``buffer[start:end]`` UTF-8? (Arrow's validator, same verdicts as Python's strict decoder.)"""
    offsets = pa.py_buffer(np.array([start, end], np.int64))
    try:
        pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, buffer]).validate(full=True)
        return True
    except pa.ArrowInvalid:
        return False


class _Block:
    __slots__ = ("block", "starts", "ends", "line_base", "offset_base", "originals")

    def __init__(self, block, starts, ends, line_base, offset_base):
        self.block, self.starts, self.ends = block, starts, ends
        self.line_base, self.offset_base = line_base, offset_base
        self.originals: dict[int, bytes] = {}  # lines masked in place by the fast path

    def line(self, i) -> bytes:
        raw = self.originals.get(int(i))
        if raw is None:
            raw = bytes(self.block[self.starts[i]:self.ends[i]])
        return raw.rstrip(b"\r")
