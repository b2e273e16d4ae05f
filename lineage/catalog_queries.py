"""Audit questions answered from the DuckDB catalog (``<storage root>/catalog.duckdb``), across artifacts:

- which checkpoints used file X (a landed file's path, name or sha256 prefix), through any chain of stages;
- what changed between checkpoint A and B: source files, per-stage code versions and configs, packages.

The catalog holds every artifact's lineage record and its lineage edges (``artifact_inputs``) and
source files (``artifact_files``), so both are recursive SQL over one file, no artifact folder read.
"""
from __future__ import annotations

import json
import os
from typing import Any

import duckdb

from batchrl.common.storage_layout import rooted_uri

CHECKPOINT_ASSETS = ("base_model", "reward_model", "policy_checkpoint", "dpo_checkpoint")

_DESCENDANTS = """
WITH RECURSIVE used(asset, data_version) AS (
    SELECT DISTINCT asset, data_version FROM artifact_files
    WHERE uri = ? OR uri LIKE ? OR (length(?) >= 8 AND sha256 LIKE ?)
    UNION
    SELECT i.asset, i.data_version FROM artifact_inputs i
    JOIN used u ON i.input_asset = u.asset AND i.input_data_version = u.data_version
)
SELECT u.asset, u.data_version, min(a.path), min(a.uri), min(a.created_at)
FROM used u JOIN artifacts a ON a.asset = u.asset AND a.data_version = u.data_version
GROUP BY u.asset, u.data_version ORDER BY min(a.created_at)
"""

_ANCESTORS = """
WITH RECURSIVE up(asset, data_version) AS (
    SELECT ?, ?
    UNION
    SELECT i.input_asset, i.input_data_version FROM artifact_inputs i
    JOIN up ON i.asset = up.asset AND i.data_version = up.data_version
)
SELECT up.asset, up.data_version,
       (SELECT a.lineage FROM artifacts a WHERE a.asset = up.asset AND a.data_version = up.data_version
        ORDER BY a.created_at DESC LIMIT 1) AS lineage
FROM up ORDER BY up.asset, up.data_version
"""


def _connect(catalog_path: str) -> duckdb.DuckDBPyConnection:
    if not os.path.exists(catalog_path):
        raise FileNotFoundError(f"no catalog at {catalog_path}: materialise something first (batchrl run)")
    return duckdb.connect(catalog_path, read_only=True)


def artifacts_using_file(catalog_path: str, file: str, assets: tuple[str, ...] | None = CHECKPOINT_ASSETS) -> list[dict]:
    """Artifacts (default: checkpoints) whose lineage includes ``file``: an exact path, a path suffix
    (``prefs_001.jsonl``) or a sha256 prefix of at least 8 hex digits."""
    exact = os.path.abspath(file) if "://" not in file else file
    with _connect(catalog_path) as con:
        rows = con.execute(_DESCENDANTS, [exact, f"%/{file.lstrip('/')}", file, f"{file.lower()}%"]).fetchall()
    return [{"asset": a, "data_version": dv, "path": path, "uri": _where_now(catalog_path, a, dv, uri),
             "created_at": str(created)} for a, dv, path, uri, created in rows if assets is None or a in assets]


def _where_now(catalog_path: str, asset: str, data_version: str, recorded_uri: str) -> str:
    """An artifact of a local root under the root this catalog lies in now (the root may have been copied or
    moved since the row was written); an ``s3://`` one where it was recorded."""
    if "://" in recorded_uri:
        return recorded_uri
    return rooted_uri(recorded_uri, asset, data_version, os.path.dirname(os.path.abspath(catalog_path)))


def find_artifact(catalog_path: str, ref: str) -> tuple[str, str]:
    """(asset, data version) of ``ref``: a data version (prefix), ``asset/data_version`` or an artifact path."""
    ref = ref.rstrip("/")
    tail = "/".join(ref.split("/")[-2:]) if "/" in ref else None
    with _connect(catalog_path) as con:
        rows = con.execute("SELECT DISTINCT asset, data_version FROM artifacts WHERE data_version LIKE ? OR path = ? "
                           "OR uri = ?", [f"{ref.split('/')[-1]}%", tail, ref]).fetchall()
    if tail:
        rows = [r for r in rows if r[0] == tail.split("/")[0]] or rows
    if len(rows) != 1:
        raise LookupError(f"{ref!r} names {len(rows)} artifacts in {catalog_path}" +
                          (f": {[f'{a}/{dv}' for a, dv in rows[:10]]}" if rows else ""))
    return rows[0]


def _ancestry(con, asset: str, data_version: str) -> dict[tuple[str, str], dict]:
    rows = con.execute(_ANCESTORS, [asset, data_version]).fetchall()
    return {(a, dv): (json.loads(lin) if lin else {}) for a, dv, lin in rows}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def diff_artifacts(catalog_path: str, a: str, b: str) -> dict[str, Any]:
    """What changed from artifact ``a`` to ``b`` over their whole lineage: source files (by hash),
    per-asset data versions, code versions and config keys, and package versions."""
    key_a, key_b = find_artifact(catalog_path, a), find_artifact(catalog_path, b)
    with _connect(catalog_path) as con:
        up_a, up_b = _ancestry(con, *key_a), _ancestry(con, *key_b)
        files = {}
        for side, keys in (("a", up_a), ("b", up_b)):
            placeholders = " OR ".join(["(asset = ? AND data_version = ?)"] * len(keys))
            params = [x for k in keys for x in k]
            files[side] = {(uri, sha) for uri, sha in con.execute(
                f"SELECT DISTINCT uri, sha256 FROM artifact_files WHERE {placeholders}", params).fetchall()}
    report: dict[str, Any] = {"a": "/".join(key_a), "b": "/".join(key_b),
                              "files_only_in_a": sorted(files["a"] - files["b"], key=str),
                              "files_only_in_b": sorted(files["b"] - files["a"], key=str), "assets": {}}
    for asset in sorted({k[0] for k in up_a} | {k[0] for k in up_b}):
        va = {dv: lin for (name, dv), lin in up_a.items() if name == asset}
        vb = {dv: lin for (name, dv), lin in up_b.items() if name == asset}
        if set(va) == set(vb):
            continue
        change: dict[str, Any] = {"data_versions": [sorted(va), sorted(vb)]}
        codes = [sorted({lin.get("code_version") for lin in v.values()}) for v in (va, vb)]
        if codes[0] != codes[1]:
            change["code_versions"] = codes
        if len(va) == 1 and len(vb) == 1:  # one version each side: name the config keys that changed
            ca = _flat((next(iter(va.values())).get("run_config") or {}))
            cb = _flat((next(iter(vb.values())).get("run_config") or {}))
            changed = {k: [ca.get(k), cb.get(k)] for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}
            if changed:
                change["config"] = changed
            parents = [{n: f"{r['asset']}/{r['data_version']}" for n, r in (next(iter(v.values())).get("inputs") or {}).items()}
                       for v in (va, vb)]
            if parents[0] != parents[1]:
                change["inputs"] = parents
        report["assets"][asset] = change
    env = [up_a.get(key_a, {}).get("environment", {}), up_b.get(key_b, {}).get("environment", {})]
    packages = [e.get("packages", {}) for e in env]
    report["packages"] = {p: [packages[0].get(p), packages[1].get(p)] for p in sorted(set(packages[0]) | set(packages[1]))
                          if packages[0].get(p) != packages[1].get(p)}
    report["git"] = [e.get("git") for e in env] if env[0].get("git") != env[1].get("git") else None
    return report


def format_diff(report: dict[str, Any]) -> str:
    lines = [f"from {report['a']}", f"  to {report['b']}"]
    for uri, sha in report["files_only_in_a"]:
        lines.append(f"  - file {uri}  sha256={str(sha)[:16]}")
    for uri, sha in report["files_only_in_b"]:
        lines.append(f"  + file {uri}  sha256={str(sha)[:16]}")
    for asset, change in report["assets"].items():
        a, b = change["data_versions"]
        lines.append(f"  ~ {asset}: {','.join(a) or '-'} -> {','.join(b) or '-'}")
        if "code_versions" in change:
            lines.append(f"      code version: {','.join(map(str, change['code_versions'][0]))} -> "
                         f"{','.join(map(str, change['code_versions'][1]))}")
        for key, (old, new) in change.get("config", {}).items():
            lines.append(f"      config {key}: {json.dumps(old)} -> {json.dumps(new)}")
        if "inputs" in change:
            old, new = change["inputs"]
            for name in sorted(set(old) | set(new)):
                if old.get(name) != new.get(name):
                    lines.append(f"      input {name}: {old.get(name)} -> {new.get(name)}")
    for name, (old, new) in report["packages"].items():
        lines.append(f"  ~ package {name}: {old} -> {new}")
    if report["git"]:
        lines.append(f"  ~ git: {report['git'][0]} -> {report['git'][1]}")
    if len(lines) == 2:
        lines.append("  (same lineage)")
    return "\n".join(lines)
