"""Log drops: each top-level entry of the preferences landing is one dynamic partition (``log_drops``).

A drop is a file directly under the landing (``prefs_002.jsonl``) or a folder / ``s3://`` prefix under it
(a batch of objects: every data file inside belongs to it). A landing that is a single file is one drop.
Hidden/underscore entries and files of unknown format (e.g. ``make_sample.py``) are not drops. A drop's
content key hashes its files' names (relative to the drop) and sha256s: the same bytes give the same key.
"""
from __future__ import annotations

import hashlib

import dagster as dg

from batchrl.common import fsutil
from batchrl.ingest.discover import detect_format
from batchrl.resources import LandingResource

LOG_DROPS = dg.DynamicPartitionsDefinition(name="log_drops")
PER_DROP_ASSETS = ("raw_logs", "cleaned_logs", "validated_preferences")  # materialised by one op, per drop
DROP_OP = "log_drop"
#: the Dagster concurrency pool of every step that writes the catalog (limit 1: see docs/PARTITIONS.md)
CATALOG_POOL = "batchrl_catalog"


def _root(landing: LandingResource) -> tuple[str, bool]:
    """The landing's preferences location without protocol, and whether it is one file."""
    fs, path = fsutil.filesystem_for(landing.preferences, landing.storage_options)
    return path.rstrip("/"), fs.isfile(path)


def _relative(uri: str, root: tuple[str, bool]) -> str | None:
    """``uri``'s path under the landing (the file's name for a one-file landing); None: not under it."""
    base, single = root
    path = uri.split("://", 1)[-1]
    if single:
        return base.rsplit("/", 1)[-1] if path == base else None
    return path[len(base) + 1:] if path.startswith(base + "/") else None


def drop_of(landing: LandingResource, uri: str, root: tuple[str, bool] | None = None) -> str | None:
    """The drop a landed file belongs to (None: not a preference log, or not a data file)."""
    relative = _relative(uri, root or _root(landing))
    if relative is None:
        return None
    parts = relative.split("/")
    if any(p.startswith((".", "_")) for p in parts) or detect_format(parts[-1])[0] == "unknown":
        return None
    return parts[0]


def landing_root(landing: LandingResource) -> str:
    """The folder (URI) the preference logs are named relative to: the landing, or the folder holding the
    one-file landing."""
    return landing.preferences.rstrip("/").rsplit("/", 1)[0] if _root(landing)[1] else landing.preferences


def drop_uri(landing: LandingResource, drop: str) -> str:
    """Where a drop's files are: the landing file itself, or ``<landing>/<drop>`` (file or folder)."""
    fsutil.safe_name(drop, "log drop")
    base, single = _root(landing)
    if single:
        if drop != base.rsplit("/", 1)[-1]:
            raise dg.Failure(f"log drop {drop!r} is not the landing file {landing.preferences}")
        return landing.preferences
    return landing.preferences.rstrip("/") + "/" + drop


def landing_drops(landing: LandingResource, state: dict[str, dict]) -> dict[str, str]:
    """drop -> content key, from a landing state (uri -> {sha256, ...}; ``automation.landing_state``)."""
    root = _root(landing)
    files: dict[str, dict[str, str]] = {}
    for uri, entry in state.items():
        drop = drop_of(landing, uri, root)
        if drop is not None:
            files.setdefault(drop, {})[_relative(uri, root)] = entry["sha256"]
    return {drop: content_key(members) for drop, members in sorted(files.items())}


def drop_content(landing: LandingResource, files: list[dict]) -> str:
    """The content key of a drop's files as ingested (``[{uri, sha256}]``), comparable with the sensor's."""
    root = _root(landing)
    return content_key({_relative(f["uri"], root) or f["uri"]: f["sha256"] for f in files})


def content_key(files: dict[str, str]) -> str:
    """Hash of a drop's content: its files' paths under the landing and their sha256s."""
    digest = hashlib.sha256()
    for path, sha in sorted(files.items()):
        digest.update(f"{path}\0{sha}\n".encode())
    return digest.hexdigest()[:16]
