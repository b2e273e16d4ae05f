"""Vectorised text cleaning on Arrow string arrays (pyarrow.compute, no per-row Python).

Order: remove control characters except ``\\n`` and ``\\t`` (C0, DEL, C1; ``\\r`` goes too) ->
Unicode NFC (only rows with non-ASCII; ASCII is already NFC) -> trim Unicode whitespace ->
optionally collapse every whitespace run to one space (off by default: it changes code and poems).
Byte-level steps (BOM, undecodable bytes) happen in the readers.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

CONTROL_RE = r"[\x00-\x08\x0B-\x1F\x7F-\x{9F}]"


def clean_text(arr: pa.Array | pa.ChunkedArray, collapse_whitespace: bool = False) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if len(arr) == 0:
        return arr
    if pc.any(pc.match_substring_regex(arr, CONTROL_RE)).as_py():
        arr = pc.replace_substring_regex(arr, CONTROL_RE, "")
    non_ascii = pc.invert(pc.string_is_ascii(arr))
    if pc.any(non_ascii).as_py():
        arr = pc.if_else(non_ascii, pc.utf8_normalize(arr, "NFC"), arr)
    arr = pc.utf8_trim_whitespace(arr)
    if collapse_whitespace:
        arr = pc.replace_substring_regex(arr, r"\s+", " ")
    return arr


def clean_table(table: pa.Table, columns: list[str], collapse_whitespace: bool = False) -> pa.Table:
    for name in columns:
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), clean_text(table.column(i), collapse_whitespace))
    return table
