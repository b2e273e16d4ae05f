"""Whole-file input faults: found before anything is written, then handled by ``IngestConfig.on_bad_file``.

A file is *bad* when it cannot be read as a whole: truncated gzip/zstd, a damaged Parquet/Arrow footer,
content that does not match its extension (a gzip named ``.jsonl``, JSON lines named ``.parquet``),
permission denied, an S3 object that cannot be fetched, a header without the contract columns.
Bad *rows* are another matter: they are quarantined one by one by the readers.

``probe`` is the cheap check of every file before a stage starts (open, magic bytes, the first
decompressed bytes, Parquet/Arrow footer and schema, CSV header, first JSON record). A fault that
only shows later (a gzip that ends early after its first megabytes) surfaces while reading as a
``FileFault``; ``with_file_policy`` then discards everything the attempt wrote (its sinks never
publish) and, with ``skip``, runs the stage again without the file: rows read before a truncation
point are never half-written. ``deep_probe`` (read every byte) runs only on these failure paths, so
that one error message can name every bad file of the drop.
"""
from __future__ import annotations

import gzip
import json
import zlib
from typing import Callable, TypeVar

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import zstandard

from batchrl.common.fsutil import filesystem_for
from batchrl.ingest.config import IngestConfig, IngestError
from batchrl.ingest.discover import InputFile, open_binary
from batchrl.ingest.records import RecordStructurer, column_contract

#: exceptions that mean "this file cannot be read", as opposed to a bug or a full disk on the write side
READ_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError, pa.ArrowException, IngestError)
HEAD_BYTES = 1 << 16
_MAGIC = ((b"\x1f\x8b", "gzip data"), (b"\x28\xb5\x2f\xfd", "zstd data"), (b"PAR1", "a Parquet file"),
          (b"ARROW1", "an Arrow IPC file"), (b"\xff\xff\xff\xff", "an Arrow IPC stream"),
          (b"PK\x03\x04", "a zip archive"), (b"%PDF", "a PDF document"))
_EXPECTED = {"gzip": "gzip data", "zstd": "zstd data"}

T = TypeVar("T")


class FileFault(Exception):
    """Raised while reading: ``uri`` cannot be read as a whole (``cause`` says why)."""

    def __init__(self, uri: str, cause: str):
        super().__init__(f"{uri}: {cause}")
        self.uri, self.cause = uri, cause


class BadInputFiles(IngestError):
    """``on_bad_file: fail``: the drop holds files that cannot be read; ``bad`` maps each to its cause."""

    def __init__(self, bad: dict[str, str]):
        self.bad = dict(sorted(bad.items()))
        first = next(iter(self.bad))
        self.source_file, self.line, self.missing, self.extra = first, 0, [], []
        lines = "\n".join(f"  {uri}: {cause}" for uri, cause in self.bad.items())
        ValueError.__init__(self, f"{len(self.bad)} input file(s) cannot be read; nothing was written "
                                  f"(on_bad_file: fail; set on_bad_file: skip to quarantine them and go on):\n{lines}")


def describe(exc: BaseException) -> str:
    """A reader exception -> the cause, in words a user can act on (the library's message kept)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, IngestError):
        return str(exc)
    if isinstance(exc, EOFError):
        return f"compressed stream ends early (truncated file?) [{text}]"
    if isinstance(exc, (zlib.error, gzip.BadGzipFile)):
        return f"corrupt gzip data [{text}]"
    if isinstance(exc, zstandard.ZstdError):
        return f"corrupt or truncated zstd data [{text}]"
    if isinstance(exc, PermissionError):
        return f"permission denied [{text}]"
    if isinstance(exc, FileNotFoundError):
        return f"file not found (removed after discovery?) [{text}]"
    if isinstance(exc, pa.ArrowInvalid):
        return f"damaged or not this format [{text}]"
    return f"cannot be read [{text}]"


def sniff(head: bytes) -> str:
    """What the first bytes look like: a binary format by its magic number, else JSON or text."""
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if not head:
        return "empty"
    body = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if body[:1] in (b"{", b"["):
        return "JSON"
    if b"\x00" in head[:1024] and head.count(b"\x00") > len(head) // 8:
        return "binary data"
    return "text"


def probe(file: InputFile, cfg: IngestConfig) -> str | None:
    """Cheap whole-file check; the cause when ``file`` cannot be read, else None."""
    if file.error:
        return file.error
    try:
        return _probe(file, cfg)
    except READ_ERRORS as e:
        return describe(e)


def _probe(file: InputFile, cfg: IngestConfig) -> str | None:
    fs, path = filesystem_for(file.uri, cfg.storage_options)
    with fs.open(path, "rb") as raw:
        stored = sniff(raw.read(HEAD_BYTES))
    name = file.uri.rsplit("/", 1)[-1]
    if file.compression and stored != _EXPECTED[file.compression]:
        return f"named {name!r} ({file.compression}) but the content is {stored} (wrong extension?)"
    if not file.compression and stored in _EXPECTED.values():
        return f"the content is {stored} but {name!r} has no .gz/.zst suffix (wrong extension?)"
    with open_binary(file, cfg.storage_options) as stream:
        head = stream.read(HEAD_BYTES)
    content = sniff(head) if head else "empty"
    if file.format == "jsonl":
        if content not in ("JSON", "text", "empty"):
            return f"named {name!r} (JSON lines) but the content is {content} (wrong extension?)"
        return _first_record(head, file, cfg) if content != "empty" else None
    if file.format == "csv":
        if content not in ("text", "empty"):
            return f"named {name!r} (CSV) but the content is {content} (wrong extension?)"
        return _csv_header(head, file, cfg) if content != "empty" else None
    if file.format == "parquet":
        if content != "a Parquet file":
            return f"named {name!r} (Parquet) but the content is {content} (wrong extension?)"
        with open_binary(file, cfg.storage_options) as stream:  # the footer: metadata and schema
            return _columns(pq.ParquetFile(stream).schema_arrow.names, file, cfg)
    if file.format == "arrow":
        with open_binary(file, cfg.storage_options) as stream:
            try:
                schema = ipc.open_file(stream).schema
            except pa.ArrowInvalid:
                stream.seek(0)
                schema = ipc.open_stream(stream).schema
        return _columns(schema.names, file, cfg)
    return None


def _nested(cfg: IngestConfig) -> bool:
    return cfg.chat_mapping is not None or any("." in k for k in cfg.field_mapping)


def _columns(names: list[str], file: InputFile, cfg: IngestConfig, line: int = 0) -> str | None:
    if _nested(cfg):  # mapping into nested values: the first-record check judges while reading
        return None
    missing, extra = column_contract(names, cfg)
    if missing or (extra and cfg.extra_fields == "error"):
        return str(IngestError(file.uri, line, "columns do not match the contract", missing, extra))
    return None


def _csv_header(head: bytes, file: InputFile, cfg: IngestConfig) -> str | None:
    first = head.split(b"\n", 1)[0]
    names = pacsv.read_csv(pa.BufferReader(first + b"\n"),
                           read_options=pacsv.ReadOptions(autogenerate_column_names=False)).column_names
    return _columns([n.removeprefix("\ufeff") for n in names], file, cfg, line=1)


def _first_record(head: bytes, file: InputFile, cfg: IngestConfig) -> str | None:
    lines = head.split(b"\n")
    if len(head) == HEAD_BYTES:
        lines = lines[:-1]  # the last one may be cut by the head
    text = [line.removeprefix(b"\xef\xbb\xbf").lstrip() for line in lines if line.strip()]
    if text and not any(line[:1] in (b"{", b"[") for line in text):
        return f"no line of the first {len(head)} bytes is a JSON object: not JSON lines (wrong extension?)"
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.removeprefix(b"\xef\xbb\xbf").decode("utf-8"), strict=False)
        except (ValueError, RecursionError):
            return None  # a bad first line is a quarantined row, like any other
        if isinstance(obj, dict):
            missing, extra = RecordStructurer(cfg).check_keys(obj)
            if missing or extra:
                return str(IngestError(file.uri, k + 1, "first record does not match the contract", missing, extra))
        return None
    return None


def deep_probe(file: InputFile, cfg: IngestConfig) -> str | None:
    """``probe`` plus a read of every byte (decompression, every Parquet row group / Arrow batch)."""
    cause = probe(file, cfg)
    if cause is not None or (file.compression is None and file.format in ("jsonl", "csv")):
        return cause  # plain text has no byte-level fault past the probe: its bad lines are bad rows
    try:
        with open_binary(file, cfg.storage_options) as stream:
            if file.format == "parquet":
                pf = pq.ParquetFile(stream)
                for i in range(pf.num_row_groups):
                    pf.read_row_group(i)
            elif file.format == "arrow":
                try:
                    reader = ipc.open_file(stream)
                    for i in range(reader.num_record_batches):
                        reader.get_batch(i)
                except pa.ArrowInvalid:
                    stream.seek(0)
                    for _ in ipc.open_stream(stream):
                        pass
            else:
                while stream.read(8 << 20):
                    pass
    except READ_ERRORS as e:
        return describe(e)
    return None


def with_file_policy(inputs: list[InputFile], cfg: IngestConfig, attempt: Callable[[dict[str, str]], T]) -> T:
    """Run ``attempt(bad)`` (``bad``: uri -> cause of the files to leave out) under ``cfg.on_bad_file``.

    fail: any bad file raises ``BadInputFiles`` naming every bad file, before the attempt writes
    anything, or after it discarded its partial outputs. skip: the attempt gets the bad files to record;
    a fault found while reading discards the attempt and runs it again without that file (and without
    any other file the deep check finds bad, so one restart usually suffices)."""
    bad = {f.uri: cause for f in inputs if (cause := probe(f, cfg)) is not None}
    while True:
        if bad and cfg.on_bad_file == "fail":
            bad.update({f.uri: c for f in inputs if f.uri not in bad and (c := deep_probe(f, cfg)) is not None})
            raise BadInputFiles(bad)
        try:
            return attempt(dict(bad))
        except FileFault as fault:
            bad[fault.uri] = fault.cause
            if cfg.on_bad_file == "skip":
                bad.update({f.uri: c for f in inputs if f.uri not in bad and (c := deep_probe(f, cfg)) is not None})
