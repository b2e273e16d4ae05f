"""Data contracts of the data plane: Arrow schemas of the Parquet files and pandera schemas.

Preference rows: ``prompt``, ``chosen``, ``rejected`` — flat strings, non-empty after cleaning,
``chosen != rejected``. Scored interaction logs: ``prompt``, ``response`` (non-empty strings) and
``score`` (finite float64). Both keep optional metadata ``id``, ``category``, ``source``,
``timestamp`` (nullable strings) plus lineage ``source_file`` / ``source_line``.

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
_META = [("category", pyarrow.string()), ("source", pyarrow.string()), ("timestamp", pyarrow.string())]

PREFERENCE_ARROW = pyarrow.schema(
    [("id", pyarrow.string()), ("prompt", pyarrow.string()), ("chosen", pyarrow.string()),
     ("rejected", pyarrow.string())] + _META + _LINEAGE)
SCORED_ARROW = pyarrow.schema(
    [("id", pyarrow.string()), ("prompt", pyarrow.string()), ("response", pyarrow.string()),
     ("score", pyarrow.float64())] + _META + _LINEAGE)
QUARANTINE_ARROW = pyarrow.schema(
    [("reason", pyarrow.string()), ("detail", pyarrow.string()), ("source_file", pyarrow.string()),
     ("source_line", pyarrow.int64()), ("raw", pyarrow.string())])

ARROW_SCHEMAS = {"preference": PREFERENCE_ARROW, "scored": SCORED_ARROW}


def _non_empty() -> pa.Check:
    return pa.Check(lambda s: s.str.len() > 0, name="empty_field")


def _text(nullable: bool = False, checks: list | None = None) -> pa.Column:
    return pa.Column(TEXT, checks=checks or [], nullable=nullable)


_META_COLUMNS = {
    "category": _text(nullable=True), "source": _text(nullable=True), "timestamp": _text(nullable=True),
    "source_file": _text(), "source_line": pa.Column("int64"),
}

PreferenceSchema = pa.DataFrameSchema(
    {
        "id": _text(),
        "prompt": _text(checks=[_non_empty()]),
        "chosen": _text(checks=[_non_empty()]),
        "rejected": _text(checks=[_non_empty()]),
        **_META_COLUMNS,
    },
    checks=[pa.Check(lambda df: df["chosen"] != df["rejected"], name="chosen_equals_rejected")],
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

PANDERA_SCHEMAS = {"preference": PreferenceSchema, "scored": ScoredSchema}
TEXT_FIELDS = {"preference": ("prompt", "chosen", "rejected"), "scored": ("prompt", "response")}


def to_pandas(table: pyarrow.Table) -> pd.DataFrame:
    """Arrow -> pandas without copying strings (pyarrow-backed string columns)."""
    return table.to_pandas(types_mapper={pyarrow.string(): TEXT}.get)
