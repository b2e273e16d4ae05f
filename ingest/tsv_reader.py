"""Example custom reader: tab-separated preference logs (``IngestConfig(reader="batchrl.ingest.tsv_reader:TsvReader")``).

Line 1 is a header of field names; each further line is one record. Values may escape ``\\t``,
``\\n`` and ``\\\\``. A line with the wrong number of columns is a ``reader_error``; the records then
go through the same mapping and contract as every other format.
"""
from __future__ import annotations

from typing import Any, BinaryIO, Iterator

from batchrl.ingest.config import IngestConfig
from batchrl.ingest.row_error import RowError

_ESCAPES = {"t": "\t", "n": "\n", "\\": "\\"}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    out, it = [], iter(value)
    for ch in it:
        if ch == "\\":
            nxt = next(it, "")
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
        else:
            out.append(ch)
    return "".join(out)


class TsvReader:
    def __init__(self, cfg: IngestConfig):
        self.cfg = cfg

    def records(self, stream: BinaryIO, source_file: str) -> Iterator[tuple[int, Any]]:
        header: list[str] | None = None
        for line_no, raw in enumerate(stream, start=1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n").removeprefix("\ufeff")
            except UnicodeDecodeError as e:
                err = RowError("undecodable", f"invalid UTF-8 at column {e.start + 1} of line {line_no}")
                err.raw = raw.decode("utf-8", errors="backslashreplace")
                yield line_no, err
                continue
            if header is None:
                header = text.split("\t")
                continue
            if not text.strip():
                continue
            values = text.split("\t")
            if len(values) != len(header):
                err = RowError("reader_error", f"{len(values)} columns, header has {len(header)}")
                err.raw = text
                yield line_no, err
                continue
            yield line_no, {k: _unescape(v) for k, v in zip(header, values)}
