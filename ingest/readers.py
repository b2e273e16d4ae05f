"""Per-format readers. Each yields ``(structured table, rejects)`` batches of at most ``batch_rows``
rows, where the table already has the contract columns (before text cleaning).

Built in: jsonl (+.gz/.zst), parquet, arrow/feather (IPC file or stream), csv. Anything else needs a
custom reader named in config as ``"module:Class"``: ``Class(cfg)`` with
``records(stream, source_file) -> Iterator[(line_no, record)]`` where ``record`` is a dict (it goes
through the same mapping and contract) or a ``RowError`` for input the reader could not parse.
"""
from __future__ import annotations

import importlib
from typing import Any, BinaryIO, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from batchrl.ingest.config import IngestConfig, IngestError
from batchrl.ingest.discover import InputFile, open_binary
from batchrl.ingest.duckjsonl import DuckJsonlReader, duckdb_applies
from batchrl.ingest.jsonl import JsonlReader
from batchrl.ingest.shapes import flat_shape
from batchrl.ingest.records import (
    ExtraFieldCounter, RecordStructurer, Reject, RowError, column_contract, raw_text, rows_to_table, structure_table,
)


class RecordReader(Protocol):
    def __init__(self, cfg: IngestConfig) -> None: ...

    def records(self, stream: BinaryIO, source_file: str) -> Iterator[tuple[int, Any]]: ...


def load_reader(spec: str) -> type:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"reader must be 'module:Class', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def jsonl_reader(file: InputFile, cfg: IngestConfig, extras: ExtraFieldCounter | None = None) -> JsonlReader:
    """DuckDB block engine where it is exact (``duckdb_applies``), else the pyarrow.json one."""
    return DuckJsonlReader(file, cfg, extras) if duckdb_applies(cfg) else JsonlReader(file, cfg, extras)


def structured_batches(file: InputFile, cfg: IngestConfig,
                       extras: ExtraFieldCounter | None = None) -> Iterator[tuple[pa.Table, list[Reject]]]:
    if file.format == "jsonl":
        yield from jsonl_reader(file, cfg, extras).batches()
    elif file.format in ("parquet", "arrow", "csv"):
        yield from _columnar(file, cfg, extras)
    elif cfg.reader:
        reader = load_reader(cfg.reader)(cfg)
        with open_binary(file, cfg.storage_options) as stream:
            yield from _records(reader.records(stream, file.uri), file, cfg, extras)
    else:
        raise IngestError(file.uri, 0, f"unknown format of {file.uri!r}; name a reader in IngestConfig.reader")


def _records(records: Iterator[tuple[int, Any]], file: InputFile, cfg: IngestConfig,
             extras: ExtraFieldCounter | None = None):
    """Reference path for record streams (custom readers, nested columnar data)."""
    structurer = RecordStructurer(cfg, extras)
    good, lines, rejects, first = [], [], [], True
    for line_no, record in records:
        if first and isinstance(record, dict):
            missing, extra = structurer.check_keys(record)
            if missing or extra:
                raise IngestError(file.uri, line_no, "first record does not match the contract", missing, extra)
        first = False
        try:
            if isinstance(record, RowError):
                raise record
            good.append(structurer(record))
            lines.append(line_no)
        except RowError as e:
            rejects.append(Reject(e.reason, e.detail, line_no, raw_text(record if not isinstance(record, RowError)
                                                                         else getattr(record, "raw", ""))))
        if len(good) + len(rejects) >= cfg.batch_rows:
            yield rows_to_table(good, lines, file.source, cfg.kind), rejects
            good, lines, rejects = [], [], []
    if good or rejects:
        yield rows_to_table(good, lines, file.source, cfg.kind), rejects


def _columnar_tables(file: InputFile, cfg: IngestConfig) -> Iterator[tuple[pa.Table, np.ndarray, list[Reject]]]:
    """(table, its line numbers, rejected lines) batches; csv line 1 is the header, columnar rows count
    from 1. CSV lines with the wrong number of columns are rejected rows, not a file error."""
    with open_binary(file, cfg.storage_options) as stream:
        if file.format == "parquet":
            first = 1
            for batch in pq.ParquetFile(stream, pre_buffer=False).iter_batches(batch_size=cfg.batch_rows):
                yield pa.Table.from_batches([batch]), np.arange(first, first + batch.num_rows, dtype=np.int64), []
                first += batch.num_rows
        elif file.format == "arrow":
            try:
                reader = ipc.open_file(stream)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                stream.seek(0)
                batches = iter(ipc.open_stream(stream))
            first = 1
            for batch in batches:
                for start in range(0, batch.num_rows, cfg.batch_rows):
                    part = batch.slice(start, cfg.batch_rows)
                    yield (pa.Table.from_batches([part]), np.arange(first, first + part.num_rows, dtype=np.int64),
                           [])
                    first += part.num_rows
        else:
            yield from _csv_tables(stream, cfg)


def _csv_tables(stream, cfg: IngestConfig):
    names = set(cfg.required) | set(cfg.metadata) | set(cfg.field_mapping)
    text_types = {n: pa.string() for n in names if n != "score" and cfg.field_mapping.get(n) != "score"}
    skipped: list[Reject] = []

    def invalid_row(row) -> str:
        skipped.append(Reject("invalid_csv_row", f"{row.actual_columns} columns, header has {row.expected_columns}",
                              row.number or 0, row.text))
        return "skip"

    try:
        reader = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=cfg.block_bytes, use_threads=False),
                                parse_options=pacsv.ParseOptions(invalid_row_handler=invalid_row),
                                convert_options=pacsv.ConvertOptions(column_types=text_types,
                                                                     strings_can_be_null=False))
    except pa.ArrowInvalid as e:
        if "Empty CSV file" in str(e):  # no header, no rows: nothing to read (like an empty JSONL file)
            return
        raise
    next_line = 2  # line 1 is the header; one physical line per record (quoted newlines make it approximate)
    for batch in reader:
        rejects, skipped[:] = list(skipped), []
        taken = np.array([r.source_line for r in rejects], np.int64)
        candidates = np.arange(next_line, next_line + batch.num_rows + len(rejects), dtype=np.int64)
        lines = candidates[~np.isin(candidates, taken)][:batch.num_rows]
        next_line = int(max(lines[-1] if len(lines) else 0, taken.max() if len(taken) else 0, next_line - 1)) + 1
        for start in range(0, max(batch.num_rows, 1), cfg.batch_rows):
            part = batch.slice(start, cfg.batch_rows)
            yield pa.Table.from_batches([part], schema=batch.schema), lines[start:start + part.num_rows], \
                (rejects if start == 0 else [])
    if skipped:  # rejected lines after the last batch
        yield reader.schema.empty_table(), np.zeros(0, np.int64), skipped


def _columnar(file: InputFile, cfg: IngestConfig, extras: ExtraFieldCounter | None = None):
    header_line = 1 if file.format == "csv" else 0
    per_record = not flat_shape(cfg)
    for table, lines, skipped in _columnar_tables(file, cfg):
        # shapes beyond flat text (message lists, transcripts, labels): the per-record reference path; pairs
        # without a prompt column may be HH transcripts, recognised per record
        if per_record or any(pa.types.is_nested(t) for t in table.schema.types) or _may_be_transcripts(table, cfg):
            for good, rejects in _records(zip(lines.tolist(), table.to_pylist()), file, cfg, extras):
                yield good, rejects + skipped
                skipped = []
            if skipped:
                yield rows_to_table([], [], file.source, cfg.kind), skipped
            continue
        structured, rejects = structure_table(table, lines, cfg, file.source,
                                              lambda i, t=table: raw_text(t.slice(i, 1).to_pylist()[0]),
                                              header_line=header_line, extras=extras)
        yield structured, rejects + skipped


def _may_be_transcripts(table: pa.Table, cfg: IngestConfig) -> bool:
    """Pairs without a prompt column (``column_contract`` lets them pass): HH transcripts, or rows to refuse."""
    return cfg.kind == "preference" and not column_contract(table.column_names, cfg)[0] and \
        "prompt" not in {cfg.field_mapping.get(c, c) for c in table.column_names}
