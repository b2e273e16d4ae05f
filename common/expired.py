"""The marker an expired artifact keeps in its folder (``EXPIRED.json``; retention: ``resources.retention``,
``runs.retention``), read and written here, below every layer that meets one: storage refuses to load an expired
artifact, audit shows it, ``batchrl export`` refuses to export one.

An expired artifact keeps its folder with ``lineage.json`` and batchrl's records beside the data
(``fsutil.RECORD_FILES``) and gains the marker: what was removed, how many bytes that freed, when, why and by what,
one entry per expiry (the carried optimizer state first, the whole artifact later).
"""
from __future__ import annotations

import json
from typing import Any

from batchrl.common import fsutil

MARKER = "EXPIRED.json"
ALL, OPTIMIZER = "all", "optimizer"  # the parts that expire: every data file, or the carried AdamW state alone


def read_marker(fs, folder: str) -> dict[str, Any] | None:
    """``folder``'s ``EXPIRED.json`` (a local folder or a path on ``fs``), None when it has none."""
    try:
        with fs.open(fsutil.join(folder, MARKER), "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def expired_parts(marker: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The parts a marker says expired, each with its (latest) entry: ``{"all": {...}, "optimizer": {...}}``."""
    return {entry["part"]: entry for entry in (marker or {}).get("expiries", [])}


def add_entry(fs, folder: str, asset: str, data_version: str, entry: dict[str, Any]) -> None:
    """Append ``entry`` to ``folder``'s marker, written whole (one rename locally, one PUT on S3): it goes first, so
    a reader never takes a half-deleted folder for a whole one."""
    marker = read_marker(fs, folder) or {"asset": asset, "data_version": data_version, "expiries": []}
    marker["expiries"].append(entry)
    fsutil.atomic_write_bytes(fs, fsutil.join(folder, MARKER), json.dumps(marker, indent=2, sort_keys=True).encode())


def size_text(n: int) -> str:
    """Bytes as retention reports them: GB for checkpoints, MB for small ones (a tiny model's)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def when_why(entry: dict[str, Any]) -> str:
    return f"on {entry.get('expired_at', '?')[:19]} by {entry.get('by', 'batchrl')} ({entry.get('reason', '')}; " \
           f"{size_text(entry.get('bytes_freed', 0))} freed)"


def expired_refusal(fs, folder: str) -> str | None:
    """Why the artifact in ``folder`` cannot be used (naming it, when and why it expired, and how to rebuild it), or
    None where its data files are there (one with only its optimizer state expired loads: its weights are there)."""
    marker = read_marker(fs, folder)
    entry = expired_parts(marker).get(ALL)
    if entry is None:
        return None
    asset, data_version = marker["asset"], marker["data_version"]
    return (f"{asset} {data_version} has expired: its data files were deleted {when_why(entry)}; its lineage.json "
            f"and EXPIRED.json stay (batchrl audit). `batchrl reproduce {asset}/{data_version}` rebuilds it into a "
            "fresh storage root; `batchrl prune --keep` pins a version so it never expires")
