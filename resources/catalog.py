"""A DuckDB catalog of every published artifact: one row per materialisation, queryable by users."""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from typing import Any

import dagster as dg
import duckdb

_SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    asset VARCHAR, data_version VARCHAR, uri VARCHAR, run_id VARCHAR,
    code_version VARCHAR, created_at TIMESTAMP, metadata JSON
)"""


class CatalogResource(dg.ConfigurableResource):
    """DuckDB file recording artifacts; `batchrl audit` and ad-hoc SQL read it."""

    path: str = ".storage/catalog.duckdb"

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
               metadata: dict[str, Any]) -> None:
        with self._connect() as con:
            con.execute(
                "INSERT INTO artifacts VALUES (?, ?, ?, ?, ?, ?, ?)",
                [asset, data_version, uri, run_id, code_version,
                 datetime.now(timezone.utc).replace(tzinfo=None), json.dumps(metadata, default=str)],
            )

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self._connect() as con:
            return con.execute(sql, params or []).fetchall()
