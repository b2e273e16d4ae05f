"""clean_logs: inputs -> cleaned.parquet (contract columns + metadata + lineage) + quarantine.parquet."""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import pyarrow as pa

from batchrl.ingest.config import IngestConfig, StageReport
from batchrl.ingest.discover import InputFile, OrderedDigest, file_sha256
from batchrl.ingest.faults import READ_ERRORS, FileFault, describe, with_file_policy
from batchrl.ingest.readers import jsonl_reader, structured_batches
from batchrl.ingest.records import ExtraFieldCounter, Reject, rows_to_table
from batchrl.ingest.sink import ParquetSink, QuarantineSink, rejects_table
from batchrl.ingest.textclean import clean_table
from batchrl.schemas import ARROW_SCHEMAS

T = TypeVar("T")
R = TypeVar("R")


def cleaned_text_columns(cfg: IngestConfig) -> list[str]:
    # ``extra`` and ``prompt_messages`` are JSON text kept as they came (nothing of them is lost or rewritten)
    return [f for f in ARROW_SCHEMAS[cfg.kind].names
            if f not in ("score", "label", "extra", "prompt_messages", "source_file", "source_line")]


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int) -> Iterator[R]:
    """``fn`` over ``items`` in ``threads`` worker threads, results in input order. At most threads + 1
    items are in flight, so memory is bounded by the item size. Arrow, numpy and DuckDB release the GIL,
    so the workers use the cores while the caller writes the results."""
    if threads <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            while len(pending) > threads + 1:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def read_ahead(items: Iterable[T], depth: int) -> Iterator[T]:
    """``items`` produced by a background thread, at most ``depth`` ahead of the caller: sequential
    reading (I/O, hashing, line counting; all release the GIL) overlaps the caller's in-order work.
    An exception of ``items`` is raised here at its place in the sequence; a caller that stops early
    stops the thread, which closes ``items`` (its open file) itself."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def offer(entry) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        source = iter(items)
        try:
            if all(offer((item, None)) for item in source):
                offer((end, None))
        except BaseException as e:  # handed to the caller, raised there
            offer((end, e))
        finally:
            getattr(source, "close", lambda: None)()

    thread = threading.Thread(target=produce, name="read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def cleaned_batches(file: InputFile, cfg: IngestConfig, then: Callable[[pa.Table], object] | None = None,
                    keep_rows: bool = True, extras: ExtraFieldCounter | None = None,
                    digests: dict[str, str] | None = None):
    """(cleaned table, rejects, then(table)) in input order. Reading is sequential; structuring,
    cleaning and ``then`` (e.g. the contract check) run per JSONL block / columnar batch in workers.
    ``keep_rows=False``: the table comes back without columns (its row count only), so results waiting
    in the queue hold only what ``then`` kept. A file listed without its sha256 (``discover_inputs(...,
    hash_files=False)``) gets it into ``digests``: JSONL hashed in the same read, other formats first."""
    if digests is not None and not file.sha256 and file.format != "jsonl":
        digests[file.uri] = file_sha256(file, cfg.storage_options)
    columns = cleaned_text_columns(cfg)

    def finish(table: pa.Table, rejects: list):
        table = clean_table(table, columns, cfg.collapse_whitespace)
        checked = then(table) if then is not None and table.num_rows else None
        return (table if keep_rows else table.select([])), rejects, checked

    if file.format == "jsonl":
        reader = jsonl_reader(file, cfg, extras)
        if digests is not None and not file.sha256:
            reader.digest = OrderedDigest()  # the one read hashes the file too
        # with workers, the blocks are read (and hashed) ahead in a thread of their own
        source = read_ahead(reader.blocks(), 2) if cfg.threads > 1 else reader.blocks()
        blocks = ordered_map(lambda block: [finish(t, r) for t, r in reader.process(*block)], source, cfg.threads)
        for results in blocks:
            yield from results
        if reader.digest is not None:
            digests[file.uri] = reader.digest.hexdigest()
    else:
        yield from ordered_map(lambda item: finish(*item), structured_batches(file, cfg, extras), cfg.threads)


def clean_logs(inputs: list[InputFile], out_dir: str | None, cfg: IngestConfig | None = None,
               on_batch=None, then=None) -> StageReport:
    """Decode, structure (mapping/flatness/types) and clean every row; stream, never load a whole file.

    Rows that cannot be structured are quarantined with a reason code; this stage finds no duplicates.
    Files that cannot be read as a whole follow ``cfg.on_bad_file`` (``faults.with_file_policy``).
    ``on_batch(table, upstream, then(table))`` sees every batch in input order (``ingest_logs`` validates
    in the same pass this way). ``out_dir=None`` writes no files: the rows this stage quarantined reach
    ``on_batch`` as ``upstream`` (a quarantine table) instead, so nothing is lost.
    """
    cfg = cfg or IngestConfig()
    return with_file_policy(inputs, cfg, lambda bad: clean_files(inputs, bad, out_dir, cfg, on_batch, then))


def _sha256_or_empty(file: InputFile, cfg: IngestConfig) -> str:
    try:
        return file_sha256(file, cfg.storage_options)
    except READ_ERRORS:
        return ""


def _batches(file: InputFile, cfg: IngestConfig, then, keep_rows: bool, extras: ExtraFieldCounter,
             digests: dict[str, str]):
    """``cleaned_batches``, with a read failure turned into a ``FileFault`` naming the file."""
    batches = cleaned_batches(file, cfg, then, keep_rows, extras, digests)
    while True:
        try:
            item = next(batches)
        except StopIteration:
            return
        except READ_ERRORS as e:
            raise FileFault(file.uri, describe(e)) from e
        yield item


def clean_files(inputs: list[InputFile], bad: dict[str, str], out_dir: str | None, cfg: IngestConfig,
                on_batch=None, then=None) -> StageReport:
    """One attempt of ``clean_logs``: the files in ``bad`` (uri -> cause) become one ``bad_file``
    quarantine entry each (source_line 0; counted as one row in and one quarantined)."""
    start = time.perf_counter()
    report = StageReport("clean_logs")
    extras = ExtraFieldCounter()
    digests: dict[str, str] = {}  # sha256 of files listed without one, taken while reading them
    sink = quarantine = None
    if out_dir is not None:
        sink = ParquetSink(out_dir, "cleaned.parquet", ARROW_SCHEMAS[cfg.kind], cfg.row_group_rows,
                           cfg.compression, cfg.storage_options)
        quarantine = QuarantineSink(out_dir, cfg)
    keep_rows = sink is not None or then is None  # else only then(table) travels back from the workers
    try:
        for file in inputs:
            report.bytes_in += file.size
            if file.uri in bad:
                if not file.sha256:  # recorded as one bad_file row: still named by its hash when readable
                    digests[file.uri] = _sha256_or_empty(file, cfg)
                cause = bad[file.uri].replace(file.uri, file.source)  # no machine path in the data
                batches = [(rows_to_table([], [], file.source, cfg.kind), [Reject("bad_file", cause, 0, "")],
                            None)]
            else:
                batches = _batches(file, cfg, then, keep_rows, extras, digests)
            for table, rejects, checked in batches:
                report.rows_in += table.num_rows + len(rejects)
                report.valid += table.num_rows
                upstream = rejects_table(rejects, file.source) if rejects and sink is None else None
                if sink is not None:
                    sink.write(table)
                    quarantine.add(rejects, file.source)
                if on_batch is not None and (table.num_rows or upstream is not None):
                    on_batch(table, upstream, checked)
                if rejects:
                    report.quarantined += len(rejects)
                    for r in rejects:
                        report.count(r.reason)
        if sink is not None:
            report.outputs = {"cleaned": sink.close(), "quarantine": quarantine.close()}
            report.content_hash = sink.sha256
            report.bytes_out = sink.size + quarantine.size
    except BaseException:
        if sink is not None:
            sink.abort()
            quarantine.abort()
        raise
    report.seconds = time.perf_counter() - start
    report.extra = {"inputs": [{"uri": f.uri, "path": f.source, "sha256": f.sha256 or digests.get(f.uri, ""),
                                "format": f.format} for f in inputs],
                    "mapped": dict(sorted(extras.routes.items())),
                    "kind": cfg.kind, "extra_fields": dict(sorted(extras.counts.items())),
                    "bad_files": [{"uri": uri, "cause": cause} for uri, cause in sorted(bad.items())]}
    return report
