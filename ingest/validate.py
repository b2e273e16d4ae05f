"""validate_preferences / validate_scored / ingest_logs: the pandera contract, long-prompt filter, dedupe.

Per batch, in worker threads (``ContractValidator.check``, order-independent): reason codes from the
Arrow twin of the schema's checks (``schemas.contract_violations``), pandera on every row that passes
(check names are reason codes), prompt token filter, duplicate key = DuckDB ``hash()`` over the fields of
``IngestConfig.dedupe_key`` (default: the contract fields, ``prompt_messages`` and ``extra``, so rows that
differ in a logged value such as log-probs are not merged; 64 bits, pinned DuckDB => stable; ``id`` when
absent is the 128-bit hex of two such hashes). Then, in input order (``dedupe``): dedupe against every
earlier row (first occurrence wins) and the writes. Quarantined and duplicate rows go to quarantine.parquet
with ``raw`` = the cleaned record as JSON (its origin is ``source_file``/``source_line``).
"""
from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pandera.pandas as pandera

from batchrl.common.fsutil import filesystem_for, join
from batchrl.ingest.config import KIND_OUTPUTS, IngestConfig, StageReport, default_dedupe_key
from batchrl.ingest.dedupe import SeenKeys
from batchrl.ingest.sink import ParquetSink, QuarantineSink, RowGroupReader
from batchrl.schemas import ARROW_SCHEMAS, PANDERA_SCHEMAS, QUARANTINE_ARROW, contract_violations, to_pandas

#: contract fields of each kind (the content id of a duplicate key made of ``id`` alone)
KEY_FIELDS = {"preference": ("prompt", "chosen", "rejected"), "scored": ("prompt", "response", "score"),
              "feedback": ("prompt", "completion", "label")}


def duplicate_key(kind: str, cfg: IngestConfig) -> tuple[str, ...]:
    """The fields hashed for the duplicate key: the config's for its own kind (``IngestConfig.dedupe_key``,
    default every logged value), every logged value for another (pairs made from scored logs)."""
    return cfg.duplicate_key if cfg.kind == kind else default_dedupe_key(kind)
FULL_GC_EVERY = 16
CHECK_ALIASES = {"not_nullable": "missing_field"}
REASON_ORDER = ("missing_field", "empty_field", "non_finite_score", "chosen_equals_rejected", "prompt_too_long")


def _detail(code: str, columns) -> str:
    return "chosen == rejected" if code == "chosen_equals_rejected" else f"{code}: {', '.join(sorted(columns))}"


class PromptLength:
    """Token count of prompts with the configured tokenizer (HF tokenizers fast batch encode);
    without ``tokenizer_path`` it counts whitespace-separated words."""

    def __init__(self, tokenizer_path: str | None):
        self.tokenizer = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            fs, path = filesystem_for(tokenizer_path)
            if fs.isdir(path):
                path = join(path, "tokenizer.json")
            with fs.open(path, "rb") as f:
                self.tokenizer = Tokenizer.from_str(f.read().decode("utf-8"))

    def __call__(self, prompts: pa.Array) -> np.ndarray:
        if self.tokenizer is None:
            return pc.list_value_length(pc.utf8_split_whitespace(prompts)).to_numpy(zero_copy_only=False)
        enc = self.tokenizer.encode_batch(prompts.to_pylist(), add_special_tokens=False)
        return np.array([len(e.ids) for e in enc], np.int64)


def cleaned_files(cleaned_dir: str, storage_options: dict | None = None, stem: str = "cleaned") -> list[str]:
    """``cleaned_dir`` may be a Parquet file or a folder with ``{stem}.parquet`` / ``{stem}-NNNNN.parquet``."""
    fs, path = filesystem_for(cleaned_dir, storage_options)
    if fs.isfile(path):
        return [cleaned_dir]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    picked = [n for n in names if n == f"{stem}.parquet" or (n.startswith(f"{stem}-") and n.endswith(".parquet"))]
    if not picked:
        raise FileNotFoundError(f"no {stem}.parquet under {cleaned_dir}")
    return [join(cleaned_dir, n) for n in picked]


@dataclass
class Checked:
    """One batch after the order-independent part of the contract (``ContractValidator.check``)."""

    table: pa.Table       # the whole batch (``id`` filled where it was null): rows are selected once, at dedupe
    keep: np.ndarray      # rows that pass the contract and filters
    key: np.ndarray       # their uint64 content keys
    quarantine: pa.Table  # the batch's other rows, with reason codes


class ContractValidator:
    """Streaming contract + filters + dedupe for one kind; shared by validate_* and scored_to_pairs.

    ``check`` is order-independent and thread-safe (the pipeline runs it in worker threads);
    ``dedupe`` runs on the batches in input order, so the first occurrence of a row wins."""

    def __init__(self, kind: str, cfg: IngestConfig):
        self.kind, self.cfg = kind, cfg
        self.schema = PANDERA_SCHEMAS[kind]
        self.seen = SeenKeys(memory_keys=cfg.dedupe_memory_keys, spill_dir=cfg.dedupe_spill_dir)
        self.length = PromptLength(cfg.tokenizer_path) if cfg.max_prompt_tokens else None
        self.con = duckdb.connect(config={"threads": 1})
        self.local = threading.local()
        self.batches = itertools.count()
        fields = duplicate_key(kind, cfg)
        key = ", ".join(fields)
        self.key_sql = f"SELECT hash({key}) AS k FROM contract_batch"
        # a content id covers the duplicate key, so rows kept apart by it never share an id
        id_key = ", ".join([f for f in fields if f != "id"] or KEY_FIELDS[kind])
        self.id_sql = (f"SELECT lower(lpad(to_hex(hash({id_key})), 16, '0') || "
                       f"lpad(to_hex(hash({id_key}, 'batchrl.id')), 16, '0')) AS cid FROM contract_batch")

    def _sql(self, sql: str, table: pa.Table) -> pa.Table:
        cursor = getattr(self.local, "cursor", None)
        if cursor is None:  # one DuckDB cursor per thread: a connection serves one query at a time
            cursor = self.local.cursor = self.con.cursor()
        cursor.register("contract_batch", table)
        try:
            return cursor.sql(sql).to_arrow_table()
        finally:
            cursor.unregister("contract_batch")

    def check(self, table: pa.Table) -> Checked:
        """Contract reason codes (Arrow checks, then pandera), long-prompt filter, content keys and the
        quarantine rows. Needs no earlier batch. The batch's text is not copied here: pandera sees every
        row (a row that failed an Arrow check keeps that first reason), and the passing rows are selected
        once, together with the duplicates, in ``dedupe``."""
        n = table.num_rows
        ids = table.column("id")
        if ids.null_count:  # content id only where the source gave none
            missing = ids.is_null().combine_chunks()
            cid = self._sql(self.id_sql, table.filter(missing)).column("cid").combine_chunks()
            table = table.set_column(0, "id", pc.replace_with_mask(ids.combine_chunks(), missing, cid))
        reason = np.full(n, None, dtype=object)
        detail = np.full(n, None, dtype=object)
        for code, mask, columns in contract_violations(table, self.kind):
            rows = np.flatnonzero(mask)
            free = reason[rows] == None  # noqa: E711
            reason[rows[free]] = code
            detail[rows[free]] = [_detail(code, c) for c, f in zip(columns, free) if f]
        # pandera is the contract: every row that reaches the output has passed it
        for code, rows, text in self._contract_failures(table):
            free = rows[reason[rows] == None]  # noqa: E711
            reason[free], detail[free] = code, text
        ok = np.flatnonzero(reason == None)  # noqa: E711
        if self.length is not None and len(ok):
            lengths = self.length(table.column("prompt").combine_chunks().take(pa.array(ok)))
            too_long = lengths > self.cfg.max_prompt_tokens
            reason[ok[too_long]] = "prompt_too_long"
            detail[ok[too_long]] = [f"prompt has {t} tokens > {self.cfg.max_prompt_tokens}"
                                    for t in lengths[too_long]]
        keep = reason == None  # noqa: E711
        key = self._sql(self.key_sql, table).column("k").to_numpy()[keep] if keep.any() else np.zeros(0, np.uint64)
        # pandera leaves reference cycles that hold this batch's DataFrame (and so its Arrow buffers):
        # collect the young generations every batch, and every FULL_GC_EVERY batches the old one too,
        # where the cycles that were still alive at a young collection end up (a full collection is slow)
        gc.collect(2 if next(self.batches) % FULL_GC_EVERY == FULL_GC_EVERY - 1 else 1)
        bad = np.flatnonzero(~keep)
        return Checked(table, keep, key, self._quarantine_rows(table, bad, reason, detail))

    def dedupe(self, checked: Checked) -> tuple[pa.Table, pa.Table, int]:
        """Exact dedupe against every earlier row -> (valid rows, quarantine rows, number of duplicates)."""
        table, keep, key = checked.table, checked.keep, checked.key
        dup = np.zeros(len(key), bool)
        if len(key):
            unique, first = np.unique(key, return_index=True)  # sorted: fast lookups below
            seen = self.seen.contains(unique)
            dup[:] = True  # later copies within the batch are duplicates
            dup[first] = seen
            self.seen.add(unique[~seen])
        quarantine = checked.quarantine
        if dup.any():
            rows = np.flatnonzero(keep)[dup]  # in the batch's numbering
            reason = np.full(len(keep), "duplicate", dtype=object)
            detail = np.full(len(keep), None, dtype=object)
            detail[rows] = [f"content key {k:016x}" for k in key[dup]]
            quarantine = pa.concat_tables([quarantine, self._quarantine_rows(table, rows, reason, detail)])
            keep = keep.copy()
            keep[rows] = False
        valid = table if keep.all() else table.filter(pa.array(keep))  # the one copy of the passing rows
        return valid, quarantine, int(dup.sum())

    def _contract_failures(self, table: pa.Table) -> Iterator[tuple[str, np.ndarray, str]]:
        try:
            self.schema.validate(to_pandas(table), lazy=True)
            return
        except pandera.errors.SchemaErrors as err:
            cases = err.failure_cases
        by_check: dict[str, dict[int, set]] = {}
        for check, column, index in zip(cases["check"], cases["column"], cases["index"]):
            if index is None or (isinstance(index, float) and np.isnan(index)):
                raise ValueError(f"{self.kind} contract: column-level failure {check} on {column}")
            check = CHECK_ALIASES.get(str(check), str(check))
            by_check.setdefault(check, {}).setdefault(int(index), set()).add(str(column))
        for code in REASON_ORDER:
            hits = by_check.pop(code, {})
            for row, cols in sorted(hits.items()):
                yield code, np.array([row], np.int64), _detail(code, cols)
        for check, hits in by_check.items():  # any other check: name it
            yield "wrong_type", np.array(sorted(hits), np.int64), f"pandera check {check}"

    def _quarantine_rows(self, table: pa.Table, bad: np.ndarray, reason, detail) -> pa.Table:
        """Rejected rows; ``raw`` is the cleaned record as JSON (sorted keys; DuckDB ``to_json``, no GIL)."""
        if not len(bad):
            return QUARANTINE_ARROW.empty_table()
        rows = table.take(pa.array(bad))
        fields = sorted(c for c in rows.column_names if c not in ("source_file", "source_line"))
        record = ", ".join(f"{f} := {f}" for f in fields)
        raw = self._sql(f"SELECT to_json(struct_pack({record})) AS raw FROM contract_batch", rows).column("raw")
        return pa.table({
            "reason": pa.array(reason[bad].tolist(), pa.string()),
            "detail": pa.array(detail[bad].tolist(), pa.string()),
            "source_file": rows.column("source_file"),
            "source_line": rows.column("source_line"),
            "raw": raw.cast(pa.string()),
        }, schema=QUARANTINE_ARROW)


class ContractStage:
    """Streams batches through ``ContractValidator`` into ``{out_name}`` + quarantine.parquet."""

    def __init__(self, out_dir: str, cfg: IngestConfig, kind: str, out_name: str, stage: str,
                 report: StageReport | None = None):
        self.start = time.perf_counter()
        self.kind, self.out_name = kind, out_name
        self.report = report or StageReport(stage)
        self.validator = ContractValidator(kind, cfg)
        self.sink = ParquetSink(out_dir, out_name, ARROW_SCHEMAS[kind], cfg.row_group_rows, cfg.compression,
                                cfg.storage_options)
        self.quarantine = QuarantineSink(out_dir, cfg)

    def check(self, table: pa.Table) -> Checked:
        """The order-independent part (thread-safe): run it in workers, then ``feed`` in input order."""
        return self.validator.check(table.select(ARROW_SCHEMAS[self.kind].names))

    def feed(self, table: pa.Table, upstream: pa.Table | None = None, checked: Checked | None = None) -> None:
        """``upstream``: rows already quarantined before this stage (counted in rows_in); ``checked``:
        ``check(table)`` when a worker already ran it."""
        report = self.report
        if upstream is not None and upstream.num_rows:
            report.rows_in += upstream.num_rows
            report.quarantined += upstream.num_rows
            self.quarantine.write(upstream)
            for code in upstream.column("reason").to_pylist():
                report.count(code)
        report.rows_in += table.num_rows
        if not table.num_rows:
            return
        valid, rejected, dups = self.validator.dedupe(checked if checked is not None else self.check(table))
        self.sink.write(valid)
        self.quarantine.write(rejected)
        report.valid += valid.num_rows
        report.duplicates += dups
        report.quarantined += rejected.num_rows - dups
        if rejected.num_rows:
            codes, counts = np.unique(rejected.column("reason").to_numpy(zero_copy_only=False), return_counts=True)
            for code, count in zip(codes, counts):
                report.count(str(code), int(count))

    def close(self) -> StageReport:
        self.validator.seen.close()
        report = self.report
        report.outputs.update({self.out_name.removesuffix(".parquet"): self.sink.close(),
                               "quarantine": self.quarantine.close()})
        report.content_hash = self.sink.sha256
        report.output_sha256.update({os.path.basename(sink.path): sink.sha256 for sink in (self.sink, self.quarantine)})
        report.bytes_out = self.sink.size + self.quarantine.size
        report.seconds = time.perf_counter() - self.start
        report.extra.setdefault("kind", self.kind)
        return report

    def abort(self) -> None:
        self.validator.seen.close()
        self.sink.abort()
        self.quarantine.abort()


def run_contract(batches: Iterator, out_dir: str, cfg: IngestConfig, kind: str, out_name: str,
                 stage: str, report: StageReport | None = None, read=None) -> StageReport:
    """Each item is a table, or (table, rows already quarantined upstream), or what ``read`` turns into
    a table. Items are read and checked in ``cfg.threads`` workers, deduplicated + written in input order."""
    from batchrl.ingest.clean import ordered_map

    contract = ContractStage(out_dir, cfg, kind, out_name, stage, report)

    def check(item):
        if read is not None:
            item = read(item)
        table, upstream = item if isinstance(item, tuple) else (item, None)
        return table, upstream, (contract.check(table) if table.num_rows else None)

    try:
        for table, upstream, checked in ordered_map(check, batches, cfg.threads):
            contract.feed(table, upstream, checked)
        return contract.close()
    except BaseException:
        contract.abort()
        raise


def _validate(cleaned_dir: str, out_dir: str, cfg: IngestConfig, kind: str, out_name: str, stage: str):
    cfg = (cfg or IngestConfig()).model_copy(update={"kind": kind})
    files = cleaned_files(cleaned_dir, cfg.storage_options)
    row_groups = RowGroupReader(files, cfg.storage_options)  # row groups are read by the workers
    try:
        report = run_contract(row_groups.items, out_dir, cfg, kind, out_name, stage, read=row_groups.read)
    finally:
        row_groups.close()
    report.bytes_in = sum(filesystem_for(f, cfg.storage_options)[0].size(filesystem_for(f, cfg.storage_options)[1])
                          for f in files)
    report.extra["inputs"] = files
    return report


def validate_preferences(cleaned_dir: str, out_dir: str, cfg: IngestConfig | None = None) -> StageReport:
    """cleaned.parquet -> preferences.parquet + quarantine.parquet (see module doc)."""
    return _validate(cleaned_dir, out_dir, cfg, "preference", "preferences.parquet", "validate_preferences")


def validate_scored(cleaned_dir: str, out_dir: str, cfg: IngestConfig | None = None) -> StageReport:
    """cleaned.parquet of scored logs -> scored.parquet + quarantine.parquet."""
    return _validate(cleaned_dir, out_dir, cfg, "scored", "scored.parquet", "validate_scored")


def validate_feedback(cleaned_dir: str, out_dir: str, cfg: IngestConfig | None = None) -> StageReport:
    """cleaned.parquet of unpaired feedback -> feedback.parquet + quarantine.parquet."""
    return _validate(cleaned_dir, out_dir, cfg, "feedback", "feedback.parquet", "validate_feedback")


def ingest_logs(inputs, out_dir: str, cfg: IngestConfig | None = None,
                keep_cleaned: bool = True) -> tuple[StageReport, StageReport]:
    """clean_logs + validate_* in one streaming pass: each block is parsed, cleaned and checked against
    the contract in a worker; dedupe and the writes follow in input order.

    ``keep_cleaned``: writes ``out_dir/cleaned/{cleaned,quarantine}.parquet`` and ``out_dir/validated/
    {preferences|scored,quarantine}.parquet``, byte-identical to running the two stages one after the
    other. Otherwise only ``out_dir/{preferences|scored,quarantine}.parquet``: one quarantine holds the
    rows of both stages and the second report accounts for every input row. (Feedback: ``feedback``.)
    The validated report's ``extra["mapped"]`` counts the rows per shape route (``ingest.shapes``).
    """
    from batchrl.ingest.clean import clean_files
    from batchrl.ingest.faults import with_file_policy

    cfg = cfg or IngestConfig()
    name, stage = KIND_OUTPUTS[cfg.kind]

    def attempt(bad: dict[str, str]) -> tuple[StageReport, StageReport]:
        contract = ContractStage(join(out_dir, "validated") if keep_cleaned else out_dir, cfg, cfg.kind, name,
                                 stage)
        try:
            cleaned = clean_files(inputs, bad, join(out_dir, "cleaned") if keep_cleaned else None, cfg,
                                  on_batch=contract.feed, then=contract.check)
            return cleaned, contract.close()
        except BaseException:
            contract.abort()
            raise

    cleaned, validated = with_file_policy(inputs, cfg, attempt)
    validated.extra.update(extra_fields=cleaned.extra["extra_fields"], bad_files=cleaned.extra["bad_files"],
                           mapped=cleaned.extra["mapped"])
    if keep_cleaned:
        validated.bytes_in = cleaned.bytes_out
        validated.extra["inputs"] = [cleaned.outputs["cleaned"]]
    else:
        validated.bytes_in = cleaned.bytes_in
        validated.extra["inputs"] = cleaned.extra["inputs"]
    return cleaned, validated
