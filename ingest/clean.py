"""clean_logs: inputs -> cleaned.parquet (contract columns + metadata + lineage) + quarantine.parquet."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import pyarrow as pa

from batchrl.ingest.config import IngestConfig, StageReport
from batchrl.ingest.discover import InputFile
from batchrl.ingest.readers import jsonl_reader, structured_batches
from batchrl.ingest.sink import ParquetSink, QuarantineSink, rejects_table
from batchrl.ingest.textclean import clean_table
from batchrl.schemas import ARROW_SCHEMAS

T = TypeVar("T")
R = TypeVar("R")


def cleaned_text_columns(cfg: IngestConfig) -> list[str]:
    return [f for f in ARROW_SCHEMAS[cfg.kind].names if f not in ("score", "source_file", "source_line")]


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


def cleaned_batches(file: InputFile, cfg: IngestConfig, then: Callable[[pa.Table], object] | None = None,
                    keep_rows: bool = True):
    """(cleaned table, rejects, then(table)) in input order. Reading is sequential; structuring,
    cleaning and ``then`` (e.g. the contract check) run per JSONL block / columnar batch in workers.
    ``keep_rows=False``: the table comes back without columns (its row count only), so results waiting
    in the queue hold only what ``then`` kept."""
    columns = cleaned_text_columns(cfg)

    def finish(table: pa.Table, rejects: list):
        table = clean_table(table, columns, cfg.collapse_whitespace)
        checked = then(table) if then is not None and table.num_rows else None
        return (table if keep_rows else table.select([])), rejects, checked

    if file.format == "jsonl":
        reader = jsonl_reader(file, cfg)
        blocks = ordered_map(lambda block: [finish(t, r) for t, r in reader.process(*block)], reader.blocks(),
                             cfg.threads)
        for results in blocks:
            yield from results
    else:
        yield from ordered_map(lambda item: finish(*item), structured_batches(file, cfg), cfg.threads)


def clean_logs(inputs: list[InputFile], out_dir: str | None, cfg: IngestConfig | None = None,
               on_batch=None, then=None) -> StageReport:
    """Decode, structure (mapping/flatness/types) and clean every row; stream, never load a whole file.

    Rows that cannot be structured are quarantined with a reason code; this stage finds no duplicates.
    ``on_batch(table, upstream, then(table))`` sees every batch in input order (``ingest_logs`` validates
    in the same pass this way). ``out_dir=None`` writes no files: the rows this stage quarantined reach
    ``on_batch`` as ``upstream`` (a quarantine table) instead, so nothing is lost.
    """
    cfg = cfg or IngestConfig()
    start = time.perf_counter()
    report = StageReport("clean_logs")
    sink = quarantine = None
    if out_dir is not None:
        sink = ParquetSink(out_dir, "cleaned.parquet", ARROW_SCHEMAS[cfg.kind], cfg.row_group_rows,
                           cfg.compression, cfg.storage_options)
        quarantine = QuarantineSink(out_dir, cfg)
    keep_rows = sink is not None or then is None  # else only then(table) travels back from the workers
    try:
        for file in inputs:
            report.bytes_in += file.size
            for table, rejects, checked in cleaned_batches(file, cfg, then, keep_rows):
                report.rows_in += table.num_rows + len(rejects)
                report.valid += table.num_rows
                upstream = rejects_table(rejects, file.uri) if rejects and sink is None else None
                if sink is not None:
                    sink.write(table)
                    quarantine.add(rejects, file.uri)
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
    report.extra = {"inputs": [{"uri": f.uri, "sha256": f.sha256, "format": f.format} for f in inputs],
                    "kind": cfg.kind}
    return report
