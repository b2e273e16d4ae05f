"""Lineage audit: which files, upstream versions, code, config and seeds produced an artifact.

Every published artifact carries ``lineage.json`` naming its inputs by (asset, uri, data version), so
the audit walks those files back to the landed logs and re-hashes the source files to show drift.
"""
from __future__ import annotations

import json
from typing import Any

from batchrl.common import fsutil
from batchrl.common.storage_layout import input_uri
from batchrl.common.expired import read_marker, size_text


def read_lineage(uri: str, storage_options: dict | None = None) -> dict[str, Any]:
    fs, path = fsutil.filesystem_for(uri, storage_options)
    with fs.open(fsutil.join(path, "lineage.json"), "r") as f:
        return json.load(f)


def read_expiries(uri: str, storage_options: dict | None = None) -> list[dict[str, Any]]:
    """What retention removed from the artifact at ``uri`` (its ``EXPIRED.json`` entries; none: whole)."""
    fs, path = fsutil.filesystem_for(uri, storage_options)
    return (read_marker(fs, path) or {}).get("expiries", [])


def _file_status(entry: dict, storage_options: dict | None) -> str:
    if "sha256" not in entry:
        return "unhashed"
    try:
        fs, path = fsutil.filesystem_for(entry["uri"], storage_options)
        return "ok" if fsutil.sha256_file(fs, path) == entry["sha256"] else "CHANGED since use"
    except FileNotFoundError:
        return "MISSING"


def lineage_tree(uri: str, storage_options: dict | None = None, _seen: dict | None = None) -> dict[str, Any]:
    """The artifact at ``uri`` with its lineage, inputs expanded recursively (shared inputs once)."""
    seen = {} if _seen is None else _seen
    if uri in seen:
        return {"ref": seen[uri]}
    lineage = read_lineage(uri, storage_options)
    node = {
        "asset": lineage["asset"], "uri": uri, "data_version": lineage["data_version"],
        "code_version": lineage.get("code_version"), "seed": lineage.get("seed"),
        "config": lineage.get("config", {}), "dagster_run_id": lineage.get("dagster_run_id"),
        "input_files": [{**f, "status": _file_status(f, storage_options)} for f in lineage.get("input_files", [])],
        "expired": read_expiries(uri, storage_options),
    }
    seen[uri] = f"{node['asset']}@{node['data_version']}"
    node["inputs"] = {name: lineage_tree(input_uri(ref, uri), storage_options, seen)
                      for name, ref in sorted(lineage.get("inputs", {}).items())}
    return node


def format_tree(node: dict[str, Any], name: str = "", indent: int = 0) -> str:
    pad = "  " * indent
    label = f"{name}: " if name else ""
    if "ref" in node:
        return f"{pad}{label}{node['ref']} (see above)\n"
    out = [f"{pad}{label}{node['asset']}@{node['data_version']}  code={node['code_version']}"
           f"  seed={node['seed']}  run={node['dagster_run_id']}\n", f"{pad}  uri: {node['uri']}\n"]
    for entry in node.get("expired", []):  # the lineage stays; these files do not
        what = "EXPIRED" if entry["part"] == "all" else f"EXPIRED {entry['part']} state"
        out.append(f"{pad}  {what} {entry['expired_at'][:19]} by {entry.get('by')}: {entry['reason']} "
                   f"({size_text(entry['bytes_freed'])} freed; batchrl reproduce rebuilds it)\n")
    if node["config"]:
        out.append(f"{pad}  config: {json.dumps(node['config'], sort_keys=True)}\n")
    for f in node["input_files"]:
        out.append(f"{pad}  file: {f['uri']}  sha256={f.get('sha256', '-')[:16]}  [{f['status']}]\n")
    for child_name, child in node["inputs"].items():
        out.append(format_tree(child, child_name, indent + 1))
    return "".join(out)


def artifact_files(node: dict[str, Any]) -> list[str]:
    """All distinct source files in a lineage tree (for a one-line summary)."""
    files = {f["uri"] for f in node.get("input_files", [])}
    for child in node.get("inputs", {}).values():
        files.update(artifact_files(child))
    return sorted(files)



def policy_chain(node: dict[str, Any]) -> list[str]:
    """``asset@version`` from a checkpoint back through its parent checkpoints to the base model: the RL
    iterations, each a lineage edge (input ``policy``: the checkpoint the rollouts were sampled from)."""
    chain, seen = [], {}

    def index(n: dict) -> None:  # shared inputs appear once in the tree, as {"ref": ...} elsewhere
        if "ref" not in n:
            seen[f"{n['asset']}@{n['data_version']}"] = n
            for child in n.get("inputs", {}).values():
                index(child)

    index(node)
    current = node
    while current is not None:
        if "ref" in current:
            current = seen.get(current["ref"])
            continue
        expired = any(entry["part"] == "all" for entry in current.get("expired", []))
        chain.append(f"{current['asset']}@{current['data_version']}" + (" [expired]" if expired else ""))
        parent = current.get("inputs", {}).get("policy")
        if parent is None and current["asset"] == "policy_checkpoint":
            parent = current["inputs"].get("rollouts", {}).get("inputs", {}).get("policy")
        current = parent
    return chain
