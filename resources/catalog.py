"""A DuckDB catalog of every published artifact: one row per materialisation, queryable by users."""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from typing import Any

import dagster as dg
import duckdb
from pydantic import Field

from batchrl.common.storage_layout import DEFAULT_ROOT, catalog_path_of

_SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    asset VARCHAR, data_version VARCHAR, uri VARCHAR, run_id VARCHAR,
    code_version VARCHAR, created_at TIMESTAMP, metadata JSON
);
ALTER TABLE artifacts ADD COLUMN IF NOT EXISTS path VARCHAR;     -- relative to the storage root
ALTER TABLE artifacts ADD COLUMN IF NOT EXISTS lineage JSON;     -- the artifact's lineage.json
-- the lineage graph, for queries across artifacts (audit.py): one row per input edge / source file
CREATE TABLE IF NOT EXISTS artifact_inputs (
    asset VARCHAR, data_version VARCHAR, input_name VARCHAR, input_asset VARCHAR, input_data_version VARCHAR
);
CREATE TABLE IF NOT EXISTS artifact_files (
    asset VARCHAR, data_version VARCHAR, uri VARCHAR, sha256 VARCHAR
);
-- retention (runs/retention.py): one row per expiry; part 'all' (every data file) or 'optimizer' (the carried AdamW
-- state); an expiry older than the artifact's latest materialisation no longer holds (a re-publication restored it)
CREATE TABLE IF NOT EXISTS artifact_expiries (
    asset VARCHAR, data_version VARCHAR, part VARCHAR, expired_at TIMESTAMP, bytes_freed BIGINT, reason VARCHAR
)"""


class CatalogResource(dg.ConfigurableResource):
    """DuckDB file recording artifacts; `batchrl audit` and ad-hoc SQL read it."""

    path: str = Field(catalog_path_of(DEFAULT_ROOT), description="the DuckDB catalog file: one row per "
                      "materialisation, with its lineage edges and source files")

    def _connect(self) -> duckdb.DuckDBPyConnection:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # DuckDB allows one writing process at a time; parallel asset steps take turns.
        for attempt in range(100):
            try:
                con = duckdb.connect(self.path)
                break
            except duckdb.IOException:
                if attempt == 99:
                    raise
                time.sleep(0.1)
        con.execute(_SCHEMA)
        return con

    def record(self, *, asset: str, data_version: str, uri: str, run_id: str, code_version: str,
               metadata: dict[str, Any], lineage: dict[str, Any] | None = None, root: str | None = None) -> None:
        """One row per materialisation; with ``lineage``, its input edges and source files too (once per
        artifact: the same content published again adds a materialisation row, not a second edge)."""
        path = uri[len(root.rstrip("/")) + 1:] if root and uri.startswith(root.rstrip("/") + "/") else None
        with self._connect() as con:
            con.execute(
                "INSERT INTO artifacts (asset, data_version, uri, run_id, code_version, created_at, metadata, path,"
                " lineage) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [asset, data_version, uri, run_id, code_version,
                 datetime.now(timezone.utc).replace(tzinfo=None), json.dumps(metadata, default=str), path,
                 json.dumps(lineage, default=str, sort_keys=True) if lineage is not None else None],
            )
            if lineage is None or con.execute("SELECT count(*) FROM artifacts WHERE asset = ? AND data_version = ?",
                                              [asset, data_version]).fetchone()[0] > 1:
                return  # edges and files of this artifact are in already
            edges = [[asset, data_version, name, ref["asset"], ref["data_version"]]
                     for name, ref in sorted(lineage.get("inputs", {}).items())]
            if edges:
                con.executemany("INSERT INTO artifact_inputs VALUES (?, ?, ?, ?, ?)", edges)
            known = {row[0] for row in con.execute("SELECT uri FROM artifact_files WHERE asset = ? AND "
                                                   "data_version = ?", [asset, data_version]).fetchall()}
            files = [[asset, data_version, f["uri"], f.get("sha256")]
                     for f in lineage.get("input_files", []) if f["uri"] not in known]
            if files:
                con.executemany("INSERT INTO artifact_files VALUES (?, ?, ?, ?)", files)

    def record_expiry(self, *, asset: str, data_version: str, part: str, expired_at: datetime, bytes_freed: int,
                      reason: str) -> None:
        with self._connect() as con:
            con.execute("INSERT INTO artifact_expiries VALUES (?, ?, ?, ?, ?, ?)",
                        [asset, data_version, part, expired_at.replace(tzinfo=None), bytes_freed, reason])

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self._connect() as con:
            return con.execute(sql, params or []).fetchall()
