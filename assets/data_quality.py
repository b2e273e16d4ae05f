"""Data-quality metadata of an ingested table, in the shapes the Dagster UI shows: one numeric key per reason
code (the Plots tab draws each across the drops), a sample of quarantined rows as a table, and the row count
and column schema of a validated table (``dagster/row_count``, ``dagster/column_schema``)."""
from __future__ import annotations

import os

import dagster as dg
import pyarrow.parquet as pq

REASON_PREFIX = "reason/"
SAMPLE_COLUMNS = ("reason", "detail", "source_file", "source_line", "raw")
RAW_CHARS = 160  # a sampled row's raw text is cut here: the table is for a glance, the file has it whole


def reason_counts(reasons: dict[str, int]) -> dict[str, int]:
    """``{"reason/<code>": rows}`` for every reason code of a stage (``duplicate`` included): numbers, not one
    JSON value, so each code is a series the UI plots per materialisation (per drop)."""
    return {f"{REASON_PREFIX}{code}": int(n) for code, n in sorted(reasons.items())}


def top_reasons(reasons: dict[str, int], n: int = 3) -> str:
    """The ``n`` most frequent reason codes, e.g. ``invalid_json=4, wrong_type=2 (+3 more codes)``; "none"."""
    ranked = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    text = ", ".join(f"{code}={count}" for code, count in ranked[:n])
    more = len(ranked) - n
    return (text + (f" (+{more} more codes)" if more > 0 else "")) if text else "none"


def quarantine_sample(path: str, per_reason: int = 2, limit: int = 20) -> dg.MetadataValue | None:
    """Up to ``per_reason`` quarantined rows of each reason code (at most ``limit``), in file order, as a
    table; None when the quarantine file is absent or empty. Control characters in the raw text are escaped
    so a row shows what was received, not boxes."""
    if not os.path.exists(path):
        return None
    table = pq.read_table(path, columns=list(SAMPLE_COLUMNS))
    if table.num_rows == 0:
        return None
    taken: dict[str, int] = {}
    records = []
    for row in table.to_pylist():
        if taken.get(row["reason"], 0) < per_reason and len(records) < limit:
            taken[row["reason"]] = taken.get(row["reason"], 0) + 1
            records.append(dg.TableRecord({
                "reason": row["reason"], "detail": printable(row["detail"] or ""),
                "source_file": row["source_file"] or "", "source_line": int(row["source_line"] or 0),
                "raw": printable((row["raw"] or "")[:RAW_CHARS])}))
    schema = dg.TableSchema(columns=[dg.TableColumn("reason"), dg.TableColumn("detail"),
                                     dg.TableColumn("source_file"), dg.TableColumn("source_line", "int"),
                                     dg.TableColumn("raw")])
    return dg.MetadataValue.table(records, schema=schema)


def printable(text: str) -> str:
    """Control characters (but tab) as ``\\xNN`` escapes."""
    return "".join(c if c.isprintable() or c == "\t" else c.encode("unicode_escape").decode() for c in text)


def table_metadata(path: str) -> dict:
    """``dagster/row_count`` and ``dagster/column_schema`` of a Parquet table (read from its footer only)."""
    parquet = pq.ParquetFile(path)
    columns = [dg.TableColumn(field.name, str(field.type)) for field in parquet.schema_arrow]
    return {"dagster/row_count": parquet.metadata.num_rows,
            "dagster/column_schema": dg.MetadataValue.table_schema(dg.TableSchema(columns=columns))}


def quality_metadata(staging: str, table: str, reasons: dict[str, int], quarantine: str = "quarantine.parquet") -> dict:
    """What a validated table's materialisation shows: row count, schema, reason counts, quarantined sample."""
    metadata = {**table_metadata(os.path.join(staging, table)), **reason_counts(reasons)}
    sample = quarantine_sample(os.path.join(staging, quarantine))
    if sample is not None:
        metadata["quarantine_sample"] = sample
    return metadata
