"""clean_logs: inputs -> cleaned.parquet (contract columns + metadata + lineage) + quarantine.parquet."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from batchrl.ingest.config import IngestConfig, StageReport
from batchrl.ingest.discover import InputFile
from batchrl.ingest.readers import jsonl_reader, structured_batches
from batchrl.ingest.sink import ParquetSink, QuarantineSink
from batchrl.ingest.textclean import clean_table
from batchrl.schemas import ARROW_SCHEMAS


def cleaned_text_columns(cfg: IngestConfig) -> list[str]:
    return [f for f in ARROW_SCHEMAS[cfg.kind].names if f not in ("score", "source_file", "source_line")]


def _cleaned_batches(file: InputFile, cfg: IngestConfig, columns: list[str]):
    """Structured + cleaned batches in input order. JSONL blocks are parsed and cleaned by
    ``cfg.threads`` workers (Arrow releases the GIL); at most threads + 2 blocks are in flight."""
    if file.format != "jsonl" or cfg.threads <= 1:
        for table, rejects in structured_batches(file, cfg):
            yield clean_table(table, columns, cfg.collapse_whitespace), rejects
        return
    reader = jsonl_reader(file, cfg)

    def work(block):
        return [(clean_table(t, columns, cfg.collapse_whitespace), r) for t, r in reader.process(*block)]

    with ThreadPoolExecutor(cfg.threads) as pool:
        pending: deque = deque()
        for block in reader.blocks():
            pending.append(pool.submit(work, block))
            while len(pending) > cfg.threads + 1:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


def clean_logs(inputs: list[InputFile], out_dir: str, cfg: IngestConfig | None = None,
               on_batch=None) -> StageReport:
    """Decode, structure (mapping/flatness/types) and clean every row; stream, never load a whole file.

    Rows that cannot be structured are quarantined with a reason code; this stage finds no duplicates.
    ``on_batch(table)`` sees every cleaned batch (used by ``ingest_preferences`` to validate in the same pass).
    """
    cfg = cfg or IngestConfig()
    start = time.perf_counter()
    report = StageReport("clean_logs")
    sink = ParquetSink(out_dir, "cleaned.parquet", ARROW_SCHEMAS[cfg.kind], cfg.row_group_rows, cfg.compression,
                       cfg.storage_options)
    quarantine = QuarantineSink(out_dir, cfg)
    columns = cleaned_text_columns(cfg)
    try:
        for file in inputs:
            report.bytes_in += file.size
            for table, rejects in _cleaned_batches(file, cfg, columns):
                report.rows_in += table.num_rows + len(rejects)
                if table.num_rows:
                    sink.write(table)
                    report.valid += table.num_rows
                    if on_batch is not None:
                        on_batch(table)
                if rejects:
                    quarantine.add(rejects, file.uri)
                    report.quarantined += len(rejects)
                    for r in rejects:
                        report.count(r.reason)
        report.outputs = {"cleaned": sink.close(), "quarantine": quarantine.close()}
    except BaseException:
        sink.abort()
        quarantine.abort()
        raise
    report.content_hash = sink.sha256
    report.bytes_out = sink.size + quarantine.size
    report.seconds = time.perf_counter() - start
    report.extra = {"inputs": [{"uri": f.uri, "sha256": f.sha256, "format": f.format} for f in inputs],
                    "kind": cfg.kind}
    return report
