"""Vectorised text cleaning on Arrow string arrays (pyarrow.compute, no per-row Python).

Order: remove control characters except ``\\n`` and ``\\t`` (C0, DEL, C1; ``\\r`` goes too) ->
Unicode NFC -> trim Unicode whitespace -> optionally collapse every whitespace run to one space (off
by default: it changes code and poems). Byte-level steps (BOM, undecodable bytes) happen in readers.

Cost is paid only where it can matter: the control-character regex runs on rows a reader flags as
candidates (JSONL: lines with ``\\u``/``\\b``/``\\f``/``\\r`` escapes or raw control bytes; other
formats: every row), NFC only on rows holding a character that NFC can change (``nfc.unstable_rows``,
numpy over the UTF-8 bytes), trimming only on rows whose first or last byte may be whitespace; the
results are scattered back with ``replace_with_mask``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.ingest.nfc import string_bytes, unstable_rows

CONTROL_RE = r"[\x00-\x08\x0B-\x1F\x7F-\x{9F}]"
CANDIDATE_COLUMN = "__control_candidates"


def _fix_where(arr: pa.Array, rows: np.ndarray, fn) -> pa.Array:
    if not len(rows):
        return arr
    mask = np.zeros(len(arr), bool)
    mask[rows] = True
    return pc.replace_with_mask(arr, pa.array(mask), fn(arr.take(pa.array(rows))))


def _matching(arr: pa.Array, pattern: str, rows: np.ndarray | None) -> np.ndarray:
    subset = arr if rows is None else arr.take(pa.array(rows))
    hit = np.flatnonzero(pc.fill_null(pc.match_substring_regex(subset, pattern), False).to_numpy(zero_copy_only=False))
    return hit if rows is None else rows[hit]


_WHITESPACE = np.zeros(256, bool)
_WHITESPACE[[9, 10, 11, 12, 13, 32]] = True
_WHITESPACE[0x80:] = True  # a non-ASCII first/last byte may belong to Unicode whitespace: trim to know


def _untrimmed_rows(arr: pa.Array) -> np.ndarray:
    """Rows whose first or last byte may be whitespace (the others are already trimmed)."""
    offsets, data = string_bytes(arr)
    nonempty = np.flatnonzero(offsets[1:] > offsets[:-1])
    if not len(nonempty):
        return nonempty
    first, last = data[offsets[nonempty]], data[offsets[nonempty + 1] - 1]
    return nonempty[_WHITESPACE[first] | _WHITESPACE[last]]


def clean_text(arr: pa.Array | pa.ChunkedArray, collapse_whitespace: bool = False,
               control_rows: np.ndarray | None = None) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if len(arr) == 0 or arr.null_count == len(arr):
        return arr
    if control_rows is None or len(control_rows):
        arr = _fix_where(arr, _matching(arr, CONTROL_RE, control_rows),
                         lambda a: pc.replace_substring_regex(a, CONTROL_RE, ""))
    arr = _fix_where(arr, unstable_rows(arr), lambda a: pc.utf8_normalize(a, "NFC"))
    untrimmed = _untrimmed_rows(arr)
    if len(untrimmed) * 8 > len(arr):  # many rows: one pass over the column beats take + scatter
        arr = pc.utf8_trim_whitespace(arr)
    else:
        arr = _fix_where(arr, untrimmed, pc.utf8_trim_whitespace)
    if collapse_whitespace:
        arr = pc.replace_substring_regex(arr, r"\s+", " ")
    return arr


def clean_table(table: pa.Table, columns: list[str], collapse_whitespace: bool = False) -> pa.Table:
    control_rows = None
    if CANDIDATE_COLUMN in table.column_names:
        control_rows = np.flatnonzero(table.column(CANDIDATE_COLUMN).to_numpy(zero_copy_only=False))
        table = table.drop_columns([CANDIDATE_COLUMN])
    for name in columns:
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), clean_text(table.column(i), collapse_whitespace,
                                                                       control_rows))
    return table
