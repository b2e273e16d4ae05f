"""The training window: validated preferences of several log drops as one table, drops in order."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

PAIR = ("prompt", "chosen", "rejected")


def first_occurrences(table: pa.Table, key_columns=PAIR) -> pa.Array:
    """Row indices of the first row of each distinct ``key_columns`` value, ascending (so the table's
    order is kept). Exports that re-send history repeat old pairs in a new drop: the earliest drop's row
    wins, so a pair's provenance is the drop that first delivered it."""
    key = pc.binary_join_element_wise(*(pc.cast(table[c], pa.string()) for c in key_columns), "\x1f")
    firsts = pa.table({"key": key, "i": pa.array(range(table.num_rows), pa.int64())}).group_by(
        "key", use_threads=False).aggregate([("i", "min")])["i_min"]
    return pc.take(firsts, pc.sort_indices(firsts))


def combine_drops(drops: list[tuple[str, str]], out_dir: str, name: str = "preferences.parquet") -> dict:
    """Concatenate ``<folder>/<name>`` of each ``(drop, folder)`` in the order given into
    ``out_dir/<name>`` with a ``drop`` column naming where each row came from. A pair (prompt, chosen,
    rejected) already taken from an earlier drop is left out and counted: each drop is deduplicated on
    its own when ingested, the window across drops. Returns ``{rows_in, rows, cross_drop_duplicates,
    rows_per_drop, rows_taken_per_drop, cross_drop_duplicates_per_drop}``."""
    tables, per_drop = [], {}
    for drop, folder in drops:
        table = pq.read_table(os.path.join(folder, name))
        per_drop[drop] = table.num_rows
        tables.append(table.append_column("drop", pa.array([drop] * table.num_rows, pa.string())))
    if not tables:
        raise ValueError("no log drops to combine: the window is empty")
    table = pa.concat_tables(tables, promote_options="default")
    rows_in = table.num_rows
    if len(tables) > 1:
        table = table.take(first_occurrences(table))
    taken = {drop: 0 for drop in per_drop}
    for drop in table["drop"].to_pylist():
        taken[drop] += 1
    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(table, os.path.join(out_dir, name))
    return {"rows_in": rows_in, "rows": table.num_rows, "cross_drop_duplicates": rows_in - table.num_rows,
            "rows_per_drop": per_drop, "rows_taken_per_drop": taken,
            "cross_drop_duplicates_per_drop": {d: per_drop[d] - taken[d] for d in per_drop}}


def first_drop(pairs):
    """The rows of a window's first drop (a DataFrame with the ``drop`` column; all rows without it)."""
    return pairs[pairs["drop"] == pairs["drop"].iloc[0]] if "drop" in pairs and len(pairs) else pairs
