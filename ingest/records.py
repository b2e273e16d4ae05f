"""Turn source records into contract-shaped rows: field mapping, chat flattening, flatness and types.

Two paths give the same answer: ``RecordStructurer`` works on one parsed record (a dict) and is the
reference; ``structure_table`` does the same on a flat Arrow table (columnar inputs, JSONL fast path).
Both produce the pre-cleaning columns of ``ARROW_SCHEMAS[kind]`` and ``Reject`` entries.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from batchrl.ingest.config import IngestConfig, IngestError
from batchrl.ingest.row_error import RowError
from batchrl.ingest.shapes import ShapeMapper, carried_fields, get_path, nested_error
from batchrl.schemas import ARROW_SCHEMAS, VALUE_FIELDS


@dataclass
class Reject:
    reason: str
    detail: str
    source_line: int
    raw: str


def raw_text(raw: bytes | str | Any) -> str:
    if isinstance(raw, bytes):
        return raw.decode("utf-8", errors="backslashreplace")
    if isinstance(raw, str):
        return raw
    return json.dumps(raw, ensure_ascii=False, default=str, sort_keys=True)


def _encodable(name: str, value: str) -> str:
    """json.loads turns a lone-surrogate escape (``\\ud800``) into a str that Arrow cannot store."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError("undecodable", f"{name} holds a lone surrogate (\\u{ord(value[e.start]):04x} escape) at "
                                      f"character {e.start + 1}: not encodable as UTF-8")
    return value


#: column of a structured table that already holds the extra-fields JSON (built by the JSONL fast path)
EXTRA_JSON_COLUMN = "__extra_json"


class ExtraFieldCounter:
    """The structuring tally shared by the worker threads: how many records carried each extra field
    (non-null values), and how many rows took each shape route (``shapes``: flat, message_lists, ...)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.routes: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, counts: dict[str, int], into: str = "counts") -> None:
        if counts:
            with self._lock:
                tally = getattr(self, into)
                for name, n in counts.items():
                    tally[name] = tally.get(name, 0) + n

    def route(self, name: str, n: int = 1) -> None:
        if n:
            self.add({name: n}, "routes")


def extra_json(fields: dict) -> str | None:
    """The non-null extra fields of one record as a JSON object (sorted keys), or None when there are none."""
    kept = {k: v for k, v in fields.items() if v is not None}
    if not kept:
        return None
    text = json.dumps(kept, ensure_ascii=False, sort_keys=True, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \u escape: keep it escaped rather than lose the row
        text = json.dumps(kept, sort_keys=True, default=str)
    return text


def extra_json_column(table: pa.Table) -> pa.Array:
    """``extra_json`` of every row of ``table`` (its columns are the extra fields); only the rows that
    hold a value are converted (usually few: the others stay null without a Python step)."""
    n = table.num_rows
    present = np.zeros(n, bool)
    for column in table.columns:
        present |= column.is_valid().to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(present)
    if not len(rows):
        return pa.nulls(n, pa.string())
    values = [extra_json(row) for row in table.take(pa.array(rows)).to_pylist()]
    if len(rows) == n:
        return pa.array(values, pa.string())
    out = np.full(n, None, dtype=object)
    out[rows] = values
    return pa.array(out, pa.string())


class RecordStructurer:
    """Reference per-record path; raises ``RowError`` with a reason code."""

    def __init__(self, cfg: IngestConfig, extras: ExtraFieldCounter | None = None):
        self.cfg = cfg
        self.extras = extras if extras is not None else ExtraFieldCounter()
        self.shape = ShapeMapper(cfg)
        self.allowed = set(cfg.required) | set(cfg.metadata)
        self.mapping = dict(cfg.field_mapping)
        self.carried = carried_fields(cfg)
        self.consumed = {p.split(".")[0] for p in self.mapping} | set(cfg.drop_fields)
        if cfg.chat_mapping and cfg.chat_mapping.messages_field:
            self.consumed.add(cfg.chat_mapping.messages_field.split(".")[0])
        self.text_fields = [f for f in cfg.required if f not in VALUE_FIELDS.values()]

    def _extra(self, obj: dict) -> list[str]:
        conversation = self.shape.conversation_field(obj)
        consumed = self.consumed | ({conversation.split(".")[0]} if conversation else set())
        return sorted(k for k in obj if k not in consumed and k not in self.allowed)

    def check_keys(self, obj: dict) -> tuple[list[str], list[str]]:
        """(missing, extra) contract fields of a record, after mapping; used for the first-record check.
        Extra fields are reported only when they make the file fail (``extra_fields: error``) or as a hint
        next to missing ones."""
        try:
            row = self._map(obj)
        except RowError:
            return [], []
        extra = self._extra(obj)
        missing = [f for f in self.cfg.required if f not in row]
        if missing and self.shape_refusal(obj, row, extra) is not None:
            return [], []  # a malformed row, quarantined with its own reason, not a file that maps wrongly
        return missing, (extra if missing or self.cfg.extra_fields == "error" else [])

    def _map(self, obj: dict) -> dict:
        row = {k: v for k, v in obj.items() if k in self.allowed and k not in self.consumed}
        for path, target in self.mapping.items():
            found, value = get_path(obj, path)
            if found:
                row[target] = value
        row["__route"] = self.shape.apply(obj, row)
        return row

    def shape_refusal(self, obj: dict, row: dict, extra: list[str]) -> RowError | None:
        """Why a record lacks contract fields when its shape says more than missing_field (ShapeMapper)."""
        try:
            return self.shape.why_missing(obj, row, extra)
        except RowError as e:
            return e

    def _extra_text(self, obj: dict, extra: list[str]) -> str | None:
        """The ``extra`` JSON: the unknown fields under ``extra_fields: keep``, and the mapped fields outside the
        contract (``carried_fields``) whatever the policy."""
        kept = {k: obj[k] for k in extra} if self.cfg.extra_fields == "keep" else {}
        for path, name in self.carried.items():
            found, value = get_path(obj, path)
            if found:
                kept[name] = value
        return extra_json(kept)

    def __call__(self, obj: Any) -> dict:
        if not isinstance(obj, dict):
            raise RowError("not_object", f"record is a JSON {type(obj).__name__}, expected an object")
        extra = self._extra(obj)
        if extra:
            present = [k for k in extra if obj[k] is not None]  # a null is no value (a columnar file's other rows)
            self.extras.add({k: 1 for k in present})
            if present and self.cfg.extra_fields in ("quarantine", "error"):
                raise RowError("extra_field", "extra fields: " + ", ".join(present))
        row = self._map(obj)
        missing = [f for f in self.cfg.required if row.get(f) is None]
        if missing:
            refusal = self.shape_refusal(obj, row, extra)
            if refusal is not None:
                raise refusal
            hint = f" (the record has other fields: {', '.join(extra)}; map them with field_mapping)" if extra else ""
            raise RowError("missing_field", "missing or null fields: " + ", ".join(missing) + hint)
        out: dict[str, Any] = {"extra": self._extra_text(obj, extra), "prompt_messages": row.get("prompt_messages")}
        for name in self.text_fields:
            out[name] = self._text(name, row[name])
        if self.cfg.kind == "scored":
            out["score"] = self.shape.score(row["score"])
        elif self.cfg.kind == "feedback":
            out["label"] = self.shape.label(row["label"])
        for name in self.cfg.metadata:
            value = row.get(name)
            if isinstance(value, (dict, list)):
                raise nested_error(name, value)
            out[name] = None if value is None else (_encodable(name, value) if isinstance(value, str)
                                                    else json.dumps(value))
        self.extras.route(row["__route"])
        return out

    @staticmethod
    def _text(name: str, value: Any) -> str:
        if isinstance(value, (dict, list)) and not value:
            raise nested_error(name, value)  # rejected: [] is empty, not nested
        if isinstance(value, (dict, list)):
            raise RowError("nested_value", f"{name} is an object/list; records must be flat "
                                           "(message lists need 'role'/'content' keys or a chat_mapping)")
        if not isinstance(value, str):
            raise RowError("wrong_type", f"{name} is {type(value).__name__}, expected a string")
        return _encodable(name, value)


def rows_to_table(rows: list[dict], lines: list[int], source_file: str, kind: str) -> pa.Table:
    schema = ARROW_SCHEMAS[kind]
    cols = {}
    for f in schema:
        if f.name == "source_file":
            cols[f.name] = pa.array([source_file] * len(rows), f.type)
        elif f.name == "source_line":
            cols[f.name] = pa.array(lines, f.type)
        else:
            cols[f.name] = pa.array([r.get(f.name) for r in rows], f.type)
    return pa.table(cols, schema=schema)


def _nested(t: pa.DataType) -> bool:
    return pa.types.is_nested(t)


def column_contract(names: list[str], cfg: IngestConfig) -> tuple[list[str], list[str]]:
    """(missing contract fields, extra fields) of flat source columns ``names`` after renames and drops."""
    renames = {src: dst for src, dst in cfg.field_mapping.items() if "." not in src}
    names = [renames.get(c, c) for c in names if c not in cfg.drop_fields and c != EXTRA_JSON_COLUMN]
    allowed = set(cfg.required) | set(cfg.metadata)
    missing = [f for f in cfg.required if f not in names]
    extra = sorted(c for c in names if c not in allowed)
    if missing == ["prompt"] and cfg.kind == "preference" and not extra:
        missing = []  # chosen/rejected alone may be HH transcripts that hold the prompt: judged per record
    return missing, extra


def structure_table(table: pa.Table, lines: np.ndarray, cfg: IngestConfig, source_file: str,
                    raw_of: Callable[[int], str], header_line: int = 1,
                    extras: ExtraFieldCounter | None = None) -> tuple[pa.Table, list[Reject]]:
    """Vectorised structure check of a flat table whose column names are source field names.

    Missing contract *columns* (and, with ``extra_fields: error``, extra ones) are a file-level contract
    error (``IngestError``); bad *values* (null, nested, wrong type) quarantine the row. Extra columns
    follow ``cfg.extra_fields``; a ready ``EXTRA_JSON_COLUMN`` (JSONL fast path) is taken as is.
    """
    renames = {src: dst for src, dst in cfg.field_mapping.items() if "." not in src}
    prebuilt = table.column(EXTRA_JSON_COLUMN) if EXTRA_JSON_COLUMN in table.column_names else None
    table = table.drop_columns([c for c in table.column_names if c in cfg.drop_fields or c == EXTRA_JSON_COLUMN])
    missing, extra = column_contract(table.column_names, cfg)
    table = table.rename_columns([renames.get(c, c) for c in table.column_names])
    if missing or (extra and cfg.extra_fields == "error"):
        raise IngestError(source_file, header_line, "columns do not match the contract", missing, extra)
    n = table.num_rows
    reason = np.full(n, None, dtype=object)
    detail = np.full(n, None, dtype=object)

    def flag(mask: np.ndarray, code: str, text: str) -> None:
        hit = mask & (reason == None)  # noqa: E711 (element-wise)
        reason[hit], detail[hit] = code, text

    out = {"extra": prebuilt if prebuilt is not None else pa.nulls(n, pa.string())}
    shape = ShapeMapper(cfg)
    extras = extras if extras is not None else ExtraFieldCounter()
    if extra:
        present = {c: table.column(c).is_valid().to_numpy(zero_copy_only=False) for c in extra}
        extras.add({c: int(m.sum()) for c, m in present.items() if m.any()})
        if cfg.extra_fields == "quarantine":
            for i in np.flatnonzero(np.logical_or.reduce(list(present.values()))):
                if reason[i] is None:
                    reason[i] = "extra_field"
                    detail[i] = "extra fields: " + ", ".join(c for c in extra if present[c][i])
        elif cfg.extra_fields == "keep":
            out["extra"] = extra_json_column(table.select(extra))
    for f in ARROW_SCHEMAS[cfg.kind]:
        name = f.name
        if name in ("source_file", "source_line", "extra"):
            continue
        if name not in table.column_names or name == "prompt_messages":  # flat rows: a one-turn prompt
            out[name] = pa.nulls(n, f.type)
            continue
        col = table.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        valid = col.is_valid().to_numpy(zero_copy_only=False) if n else np.zeros(0, bool)
        required = name in cfg.required
        if required:
            flag(~valid, "missing_field", f"missing or null fields: {name}")
        if _nested(col.type):
            flag(valid, "nested_value", f"{name} is an object/list; records must be flat")
            out[name] = pa.nulls(n, f.type)
        elif name == "score":
            if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_decimal(col.type):
                out[name] = col.cast(pa.float64())
            elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):  # CSV text, text ratings
                out[name], bad = shape.score_column(col.cast(pa.string()))
                flag(bad, "wrong_type", "score is not a number (map text ratings with score_values)")
            else:
                flag(valid, "wrong_type", f"score is {col.type}, expected a number")
                out[name] = pa.nulls(n, f.type)
        elif name == "label":
            if pa.types.is_boolean(col.type) or pa.types.is_integer(col.type) or pa.types.is_floating(col.type) \
                    or pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                out[name], bad = shape.label_column(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
                flag(bad, "unknown_label", "label is not a known thumbs value (add it to label_values)")
            else:
                flag(valid, "wrong_type", f"label is {col.type}, expected a bool or a thumbs value")
                out[name] = pa.nulls(n, f.type)
        elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            out[name] = col.cast(pa.string())
        elif required:
            flag(valid, "wrong_type", f"{name} is {col.type}, expected a string")
            out[name] = pa.nulls(n, f.type)
        else:  # metadata: numbers, timestamps, booleans are kept as their string form
            out[name] = col.cast(pa.string())
    out["source_file"] = pa.array([source_file], pa.string()).take(pa.array(np.zeros(n, np.int32)))
    out["source_line"] = pa.array(lines, pa.int64())
    result = pa.table(out, schema=ARROW_SCHEMAS[cfg.kind])
    bad = np.flatnonzero(reason != None)  # noqa: E711
    rejects = [Reject(reason[i], detail[i], int(lines[i]), raw_of(int(i))) for i in bad]
    if len(bad):
        keep = np.ones(n, bool)
        keep[bad] = False
        result = result.filter(pa.array(keep))
    extras.route("flat", result.num_rows)
    return result, rejects
