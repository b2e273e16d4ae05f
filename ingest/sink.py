"""Deterministic, atomic Parquet output to a local folder or an object store.

Row groups have a fixed size (``row_group_rows``) whatever the input batching, so the same rows give
the same bytes. The file is written to a local temporary path first; locally it is renamed into place,
on an object store it is uploaded in one ``put`` (readers never see a partial file). Its sha256 is the
data version.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.common.fsutil import filesystem_for, is_local, join
from batchrl.schemas import QUARANTINE_ARROW

DICTIONARY_COLUMNS = {"category", "source", "source_file", "reason", "timestamp"}
LONG_TEXT_COLUMNS = {"prompt", "chosen", "rejected", "response", "completion", "prompt_messages", "detail", "raw"}


class FileHasher:
    """sha256 of a file that is being appended to, fed from the bytes already on disk after each row
    group (page cache, no GIL for large reads and updates): the writer keeps a native, GIL-free file,
    and no second pass over the whole output is needed at the end."""

    def __init__(self, path: str):
        self.path, self.sha256, self.size, self.file = path, hashlib.sha256(), 0, None

    def update(self) -> None:
        if self.file is None:
            self.file = open(self.path, "rb")
        while chunk := self.file.read(8 << 20):
            self.sha256.update(chunk)
            self.size += len(chunk)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class ParquetSink:
    """Row groups are encoded and written by one background thread, in order, while the caller goes on
    (deduplicating the next batch): Parquet encoding was ~1.5 s of the serial, in-order part of an ingest.
    At most ``MAX_IN_FLIGHT`` row groups wait; an error of the writer surfaces at the next write or close."""

    MAX_IN_FLIGHT = 2

    def __init__(self, out_dir: str, name: str, schema: pa.Schema, row_group_rows: int = 65536,
                 compression: str = "zstd", storage_options: dict | None = None):
        self.fs, self.dir_path = filesystem_for(out_dir, storage_options)
        self.uri = join(out_dir, name)
        self.path = join(self.dir_path, name)
        self.schema, self.row_group_rows = schema, row_group_rows
        self.local = is_local(self.fs)
        if self.local:
            os.makedirs(self.dir_path, exist_ok=True)
            self.tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        else:
            fd, self.tmp = tempfile.mkstemp(suffix=".parquet")
            os.close(fd)
        low_cardinality = [n for n in schema.names if n in DICTIONARY_COLUMNS]
        # min/max statistics only where they prune (ids, metadata, lineage): on long texts they cost time
        with_stats = [n for n in schema.names if n not in LONG_TEXT_COLUMNS]
        self.writer = pq.ParquetWriter(self.tmp, schema, compression=compression, write_statistics=with_stats,
                                       store_schema=True, use_dictionary=low_cardinality)
        self.hasher = FileHasher(self.tmp)
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="parquet-sink")
        self.in_flight: deque = deque()
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.rows = 0
        self.sha256 = ""
        self.size = 0

    def write(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        self.pending.append(table.select(self.schema.names).cast(self.schema))
        self.pending_rows += table.num_rows
        self.rows += table.num_rows
        while self.pending_rows >= self.row_group_rows:
            self._flush(self.row_group_rows)

    def _flush(self, n: int) -> None:
        merged = pa.concat_tables(self.pending)
        while len(self.in_flight) >= self.MAX_IN_FLIGHT:
            self.in_flight.popleft().result()  # bounded memory; re-raises a failed write
        self.in_flight.append(self.encoder.submit(self._write_group, merged.slice(0, n), n))
        rest = merged.slice(n)
        self.pending = [rest] if rest.num_rows else []
        self.pending_rows = rest.num_rows

    def _write_group(self, table: pa.Table, n: int) -> None:
        # one contiguous chunk per column (copied here, off the caller's thread): page boundaries must
        # not depend on input batching
        self.writer.write_table(table.combine_chunks(), row_group_size=n)
        self.hasher.update()

    def _drain(self) -> None:
        """Wait for every queued row group (the first failure is raised) and stop the writer thread."""
        try:
            while self.in_flight:
                self.in_flight.popleft().result()
        finally:
            for future in self.in_flight:
                future.cancel()
            self.in_flight.clear()
            self.encoder.shutdown(wait=True)

    def close(self) -> str:
        if self.pending_rows:
            self._flush(self.pending_rows)
        self._drain()
        self.writer.close()
        self.hasher.update()
        self.hasher.close()
        self.sha256, self.size = self.hasher.sha256.hexdigest(), self.hasher.size
        if self.local:
            os.replace(self.tmp, self.path)
        else:
            self.fs.put_file(self.tmp, self.path)
            os.unlink(self.tmp)
        return self.uri

    def abort(self) -> None:
        try:
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - aborting anyway: the partial file is removed below
                pass
            self.writer.close()
            self.hasher.close()
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


class QuarantineSink(ParquetSink):
    """quarantine.parquet: reason, detail, source_file, source_line, raw."""

    def __init__(self, out_dir: str, cfg, name: str = "quarantine.parquet"):
        super().__init__(out_dir, name, QUARANTINE_ARROW, cfg.row_group_rows, cfg.compression, cfg.storage_options)

    def add(self, rejects, source_file: str | None = None) -> None:
        if rejects:
            self.write(rejects_table(rejects, source_file))

    def add_table(self, table: pa.Table) -> None:
        self.write(table)


def rejects_table(rejects, source_file: str | None = None) -> pa.Table:
    """``Reject`` entries -> quarantine rows (source_file from the argument, else from each entry)."""
    return pa.table({
        "reason": [r.reason for r in rejects],
        "detail": [r.detail for r in rejects],
        "source_file": [source_file if source_file is not None else getattr(r, "source_file", None)
                        for r in rejects],
        "source_line": pa.array([r.source_line for r in rejects], pa.int64()),
        "raw": [r.raw for r in rejects],
    }, schema=QUARANTINE_ARROW)


class RowGroupReader:
    """Row groups of Parquet files read by index from any thread (one open handle per thread and file),
    so workers can read in parallel while the caller keeps the output in input order."""

    def __init__(self, uris: list[str], storage_options: dict | None = None):
        self.uris, self.storage_options = uris, storage_options
        self.local = threading.local()
        self.handles: list = []  # every thread's open files, closed by close()
        self.items = []
        for uri in uris:
            fs, path = filesystem_for(uri, storage_options)
            with fs.open(path, "rb") as f:
                self.items += [(uri, i) for i in range(pq.ParquetFile(f).num_row_groups)]

    def read(self, item: tuple[str, int]) -> pa.Table:
        uri, index = item
        files = self.local.__dict__.setdefault("files", {})
        if uri not in files:
            fs, path = filesystem_for(uri, self.storage_options)
            handle = fs.open(path, "rb")
            self.handles.append(handle)
            files[uri] = pq.ParquetFile(handle, pre_buffer=False)
        return files[uri].read_row_group(index)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles.clear()
