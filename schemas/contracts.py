"""Data contracts of the data plane: Arrow schemas of the Parquet files and pandera schemas.

Preference rows: ``prompt``, ``chosen``, ``rejected`` — flat strings, non-empty after cleaning,
``chosen != rejected``. Scored interaction logs: ``prompt``, ``response`` (non-empty strings) and
``score`` (finite float64). Unpaired feedback (thumbs): ``prompt``, ``completion`` (non-empty strings) and
``label`` (bool, non-null: True = desirable). All keep optional metadata ``id``, ``category``, ``source``,
``timestamp`` (nullable strings), ``extra`` (the record's other non-null fields as one JSON object, null
when it had none; ``IngestConfig.extra_fields``), ``prompt_messages`` (the prompt as a JSON list of
``{role, content}`` when it came from a multi-turn conversation, null for a single user turn: a trainer
renders it with the model's chat template; ``prompt`` then holds a plain ``role: content`` rendering) plus
lineage ``source_file`` (the file's path relative to the landing root) / ``source_line``.

Check names are the quarantine reason codes, so a pandera failure maps straight to a reason.
pandera runs on whole batches (pyarrow-backed pandas columns, vectorised checks).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa
import pyarrow

TEXT = pd.ArrowDtype(pyarrow.string())

_LINEAGE = [("source_file", pyarrow.string()), ("source_line", pyarrow.int64())]
_META = [("category", pyarrow.string()), ("source", pyarrow.string()), ("timestamp", pyarrow.string()),
         ("extra", pyarrow.string()), ("prompt_messages", pyarrow.string())]

PREFERENCE_ARROW = pyarrow.schema(
    [("id", pyarrow.string()), ("prompt", pyarrow.string()), ("chosen", pyarrow.string()),
     ("rejected", pyarrow.string())] + _META + _LINEAGE)
SCORED_ARROW = pyarrow.schema(
    [("id", pyarrow.string()), ("prompt", pyarrow.string()), ("response", pyarrow.string()),
     ("score", pyarrow.float64())] + _META + _LINEAGE)
FEEDBACK_ARROW = pyarrow.schema(
    [("id", pyarrow.string()), ("prompt", pyarrow.string()), ("completion", pyarrow.string()),
     ("label", pyarrow.bool_())] + _META + _LINEAGE)
QUARANTINE_ARROW = pyarrow.schema(
    [("reason", pyarrow.string()), ("detail", pyarrow.string()), ("source_file", pyarrow.string()),
     ("source_line", pyarrow.int64()), ("raw", pyarrow.string())])

ARROW_SCHEMAS = {"preference": PREFERENCE_ARROW, "scored": SCORED_ARROW, "feedback": FEEDBACK_ARROW}


def _non_empty() -> pa.Check:
    return pa.Check(lambda s: s != "", name="empty_field")  # compares lengths first: no scan of the text


def _text(nullable: bool = False, checks: list | None = None) -> pa.Column:
    return pa.Column(TEXT, checks=checks or [], nullable=nullable)


_META_COLUMNS = {
    "category": _text(nullable=True), "source": _text(nullable=True), "timestamp": _text(nullable=True),
    "extra": _text(nullable=True), "prompt_messages": _text(nullable=True), "source_file": _text(),
    "source_line": pa.Column("int64"),
}

PreferenceSchema = pa.DataFrameSchema(
    {
        "id": _text(),
        "prompt": _text(checks=[_non_empty()]),
        "chosen": _text(checks=[_non_empty()]),
        "rejected": _text(checks=[_non_empty()]),
        **_META_COLUMNS,
    },
    # a null side is judged by its nullability check; fillna keeps NAs from hiding the other rows
    checks=[pa.Check(lambda df: (df["chosen"] != df["rejected"]).fillna(True), name="chosen_equals_rejected")],
    strict=True,
    ordered=True,
    name="preference",
)

ScoredSchema = pa.DataFrameSchema(
    {
        "id": _text(),
        "prompt": _text(checks=[_non_empty()]),
        "response": _text(checks=[_non_empty()]),
        # NaN is "null" to pandas: let the finite check (ignore_na=False) name it
        "score": pa.Column("float64", nullable=True,
                           checks=[pa.Check(lambda s: np.isfinite(s), name="non_finite_score", ignore_na=False)]),
        **_META_COLUMNS,
    },
    strict=True,
    ordered=True,
    name="scored",
)

FeedbackSchema = pa.DataFrameSchema(
    {
        "id": _text(),
        "prompt": _text(checks=[_non_empty()]),
        "completion": _text(checks=[_non_empty()]),
        "label": pa.Column(pd.ArrowDtype(pyarrow.bool_())),
        **_META_COLUMNS,
    },
    strict=True,
    ordered=True,
    name="feedback",
)

PANDERA_SCHEMAS = {"preference": PreferenceSchema, "scored": ScoredSchema, "feedback": FeedbackSchema}
TEXT_FIELDS = {"preference": ("prompt", "chosen", "rejected"), "scored": ("prompt", "response"),
               "feedback": ("prompt", "completion")}
#: the non-text contract field of a kind, whose null is a missing_field
VALUE_FIELDS = {"scored": "score", "feedback": "label"}


def to_pandas(table: pyarrow.Table) -> pd.DataFrame:
    """Arrow -> pandas without copying strings (pyarrow-backed string columns)."""
    return table.to_pandas(types_mapper={pyarrow.string(): TEXT, pyarrow.bool_(): pd.ArrowDtype(pyarrow.bool_())}.get)


def contract_violations(table: pyarrow.Table, kind: str) -> list[tuple[str, np.ndarray, list[str]]]:
    """The schema's row checks evaluated on Arrow columns (one vectorised pass, no pandas):
    ``[(check name, failing row mask, per-row names of the failing columns)]`` in the order
    missing_field, empty_field, non_finite_score, chosen_equals_rejected. Used to give each failing row
    its reason code cheaply; pandera still validates every row that passes (``ContractValidator``), and
    a test keeps the two in agreement."""
    import pyarrow.compute as pc

    def mask(values) -> np.ndarray:
        return pc.fill_null(values, False).to_numpy(zero_copy_only=False)

    text = TEXT_FIELDS[kind]
    nullable = text + ((VALUE_FIELDS[kind],) if kind == "feedback" else ())  # a null score: non_finite_score
    nulls = {c: table.column(c).is_null().to_numpy(zero_copy_only=False) for c in nullable
             if table.column(c).null_count}
    empty = {c: mask(pc.equal(pc.binary_length(table.column(c)), 0)) for c in text}
    out = []
    for code, per_column in (("missing_field", nulls), ("empty_field", empty)):
        hits = [(c, m) for c, m in per_column.items() if m.any()]
        if hits:
            any_hit = np.logical_or.reduce([m for _, m in hits])
            rows = np.flatnonzero(any_hit)
            out.append((code, any_hit, [[c for c, m in hits if m[i]] for i in rows]))
    if kind == "scored":
        bad = ~mask(pc.is_finite(table.column("score")))
        if bad.any():
            out.append(("non_finite_score", bad, [["score"]] * int(bad.sum())))
    elif kind == "preference":
        same = mask(pc.equal(table.column("chosen"), table.column("rejected")))
        if same.any():
            out.append(("chosen_equals_rejected", same, [["chosen", "rejected"]] * int(same.sum())))
    return out
