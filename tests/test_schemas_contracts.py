"""The pandera contracts themselves: check names are reason codes; strict columns; flat strings."""
from __future__ import annotations

import math

import pandas as pd
import pandera.pandas as pa
import pyarrow
import pytest

from batchrl.schemas import PREFERENCE_ARROW, SCORED_ARROW, PreferenceSchema, ScoredSchema, to_pandas


def frame(schema, **cols):
    n = len(next(iter(cols.values())))
    base = {f.name: [None] * n for f in schema}
    base.update(id=[f"i{k}" for k in range(n)], source_file=["f"] * n, source_line=list(range(1, n + 1)))
    base.update(cols)
    return to_pandas(pyarrow.Table.from_pydict(base, schema=schema))


def failed_checks(schema, df) -> dict[int, set]:
    try:
        schema.validate(df, lazy=True)
        return {}
    except pa.errors.SchemaErrors as err:
        out: dict[int, set] = {}
        for check, index in zip(err.failure_cases["check"], err.failure_cases["index"]):
            out.setdefault(int(index), set()).add(str(check))
        return out


def test_preference_contract_names_reasons():
    df = frame(PREFERENCE_ARROW, prompt=["p", "p", "", "p"], chosen=["a", "same", "a", ""], rejected=["b", "same", "b", "b"])
    assert failed_checks(PreferenceSchema, df) == {1: {"chosen_equals_rejected"}, 2: {"empty_field"},
                                                   3: {"empty_field"}}


def test_scored_contract_finite_score():
    df = frame(SCORED_ARROW, prompt=["p"] * 4, response=["r"] * 4, score=[0.5, math.nan, math.inf, -1.0])
    assert failed_checks(ScoredSchema, df) == {1: {"non_finite_score"}, 2: {"non_finite_score"}}


def test_contract_is_strict_about_columns_and_types():
    df = frame(PREFERENCE_ARROW, prompt=["p"], chosen=["a"], rejected=["b"])
    with pytest.raises((pa.errors.SchemaError, pa.errors.SchemaErrors)):
        PreferenceSchema.validate(df.assign(unknown=["x"]))
    with pytest.raises((pa.errors.SchemaError, pa.errors.SchemaErrors)):
        PreferenceSchema.validate(df.assign(chosen=pd.Series([{"nested": 1}], dtype=object)))
    pd.testing.assert_frame_equal(PreferenceSchema.validate(df), df)  # the well-formed frame passes, unchanged
