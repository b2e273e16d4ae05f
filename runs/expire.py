"""Expiring an artifact so that the space is really freed (``runs.retention`` plans what expires).

What goes: the artifact's data files under the storage root (a local folder or an s3:// prefix; for the optimizer
part, ``optimizer/`` alone), this host's cache copy of an s3:// artifact, and the trainer work dir it was exported
from (``assets.common.train_and_publish`` records it). That last one matters: a published checkpoint's files are
hard links of the work dir's export, so deleting the published folder alone frees nothing. Bytes freed count each
file's inode once and only where every link to it goes: what stays linked from elsewhere (the work dir of an
artifact published before work dirs were recorded, left alone) is reported as still linked, not freed.

Order: the ``EXPIRED.json`` marker first (a reader from then on is told the artifact expired, never handed a
half-deleted folder), then the files, then the catalog row. A crash in between leaves the marker: the next prune,
finding no catalog row, expires the rest.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone

from batchrl.common import fsutil
from batchrl.common.expired import ALL, add_entry
from batchrl.resources.retention import KEPT_FILES, OPTIMIZER_FOLDER
from batchrl.runs.retention import Expiry


@dataclass(frozen=True)
class Freed:
    """What one expiry removes (or would, in a dry run)."""

    expiry: Expiry
    removed: tuple[str, ...]  # top-level names under the artifact's folder
    bytes_freed: int  # stored bytes no longer held anywhere: s3 objects, and local inodes whose every link went
    still_linked_bytes: int  # local bytes of removed files that stay linked from elsewhere (not freed)
    work_dir: str | None  # the work dir removed (absolute); None: not recorded for this artifact


def _doomed(fs, path: str, part: str) -> list[str]:
    """The top-level entries of the artifact folder that ``part`` removes."""
    if part != ALL:
        return [OPTIMIZER_FOLDER] if fs.isdir(fsutil.join(path, OPTIMIZER_FOLDER)) else []
    names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    return sorted(name for name in names if name not in KEPT_FILES)


def _local_files(paths: list[str]) -> list[str]:
    files = []
    for path in paths:
        if os.path.isfile(path) or os.path.islink(path):
            files.append(path)
        for folder, _, names in os.walk(path):
            files += [os.path.join(folder, name) for name in names]
    return files


def _inode_bytes(own: list[str], work: list[str]) -> tuple[int, int]:
    """``(freed, still linked)``: the bytes of the inodes whose every link is among the artifact's own files and
    its work dir's, and those of its own files' inodes linked from elsewhere too (work-dir files linked from the
    folder that stays, e.g. the weights of a checkpoint losing its optimizer state, are neither)."""
    seen: dict[tuple[int, int], list] = {}
    for path, is_own in [(p, True) for p in own] + [(p, False) for p in work]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # gone meanwhile
            continue
        entry = seen.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size, False])
        entry[0] += 1
        entry[3] |= is_own
    freed = sum(size for count, links, size, _ in seen.values() if count >= links)
    return freed, sum(size for count, links, size, is_own in seen.values() if count < links and is_own)


def _work_dir(cache_dir: str, recorded: str) -> str:
    """The recorded work dir under ``<cache_dir>/_work`` (assets.common.work_dir), or ValueError: a catalog row must
    not make retention delete anything else."""
    base = os.path.realpath(os.path.join(cache_dir, "_work"))
    path = os.path.realpath(os.path.join(cache_dir, recorded))
    if path == base or os.path.commonpath([base, path]) != base:
        raise ValueError(f"the work dir {recorded!r} recorded in the catalog is not one under {base}: not deleted")
    return path


def measure(storage, expiry: Expiry) -> Freed:
    """What ``expiry`` removes and the bytes that frees, nothing deleted (a dry run shows this)."""
    version = expiry.version
    fs, path = storage.artifact_location(version.ref)
    removed = _doomed(fs, path, expiry.part)
    targets = [fsutil.join(path, name) for name in removed]
    local = list(targets) if storage.is_local() else []
    remote = 0 if storage.is_local() else sum(fs.du(target) for target in targets)
    if not storage.is_local():  # this host's copy: all of it, or its optimizer folder
        cached = storage.cached_path(version.asset, version.data_version)
        local.append(cached if expiry.part == ALL else os.path.join(cached, OPTIMIZER_FOLDER))
    work = _work_dir(storage.cache_dir, expiry.work_dir) if expiry.work_dir else None
    freed, linked = _inode_bytes(_local_files(local), _local_files([work] if work else []))
    return Freed(expiry, tuple(removed), remote + freed, linked, work)


def expire(storage, catalog, expiry: Expiry, by: str) -> Freed:
    """Expire ``expiry``'s part of its artifact: marker, files, work dir, catalog row (the module docstring)."""
    freed = measure(storage, expiry)
    version = expiry.version
    fs, path = storage.artifact_location(version.ref)
    now = datetime.now(timezone.utc)
    entry = {"part": expiry.part, "removed": list(freed.removed), "bytes_freed": freed.bytes_freed,
             "still_linked_bytes": freed.still_linked_bytes, "expired_at": now.isoformat(), "reason": expiry.reason,
             "by": by, "work_dir": expiry.work_dir}
    add_entry(fs, path, version.asset, version.data_version, entry)
    for name in freed.removed:
        fs.rm(fsutil.join(path, name), recursive=True)
    if not storage.is_local():
        cached = storage.cached_path(version.asset, version.data_version)
        if expiry.part == ALL:
            shutil.rmtree(cached, ignore_errors=True)
        elif os.path.isdir(cached):  # the copy the next update reads says its state expired, as the root's does
            add_entry(fsutil.filesystem_for(cached)[0], cached, version.asset, version.data_version, entry)
            shutil.rmtree(os.path.join(cached, OPTIMIZER_FOLDER), ignore_errors=True)
    if freed.work_dir:  # its export's links; for an update, its resume record too (a rerun would find it complete)
        shutil.rmtree(freed.work_dir, ignore_errors=True)
    catalog.record_expiry(asset=version.asset, data_version=version.data_version, part=expiry.part, expired_at=now,
                          bytes_freed=freed.bytes_freed, reason=expiry.reason)
    return freed
