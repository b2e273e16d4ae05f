"""Room on disk for the next RL iteration: `batchrl run` stops its loop at an iteration's boundary, saying why,
before a checkpoint fills the file system mid-write (a full disk fails deep inside a step: Dagster's SQLite,
a half-written export). Each iteration publishes a new policy checkpoint (with ``carry_optimizer_state`` also
AdamW's moments: 8 bytes per parameter), and old ones stay unless a retention policy expires them (`batchrl prune`,
a profile's ``retention:``, ``runs/retention.py``), so the next iteration needs about what the last one published."""
from __future__ import annotations

import os
import shutil

GB = 1 << 30
RETENTION_HINT = ("old checkpoints and carried optimizer states expire with a retention policy: --keep-last N "
                  "--optimizer-states K, a profile's retention:, or `batchrl prune`")


def folder_bytes(path: str) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:  # gone meanwhile
                pass
    return total


def published_bytes(done: list[dict], cache_dir: str) -> int:
    """The bytes the finished steps ``done`` (``RunProgress.done``) published on this host: each artifact's folder
    under a local root, or its copy in ``cache_dir`` (an S3 root: the copy its publisher keeps)."""
    total = 0
    for step in done:
        meta = step.get("metadata") or {}
        uri, version = str(meta.get("uri", "")), str(meta.get("data_version", ""))
        local = uri if os.path.isdir(uri) else os.path.join(cache_dir, step["asset"], version)
        if step.get("ok") and version and os.path.isdir(local):
            total += folder_bytes(local)
    return total


def shortfall(paths: list[str], need_bytes: int, keep_free_gb: float) -> str | None:
    """Where ``need_bytes`` more would leave less than ``keep_free_gb`` free (each path's nearest existing folder's
    file system), said in one line; None where there is room."""
    for path in dict.fromkeys(paths):
        while path and not os.path.exists(path):
            path = os.path.dirname(path)
        if not path:
            continue
        free = shutil.disk_usage(path).free
        if free < need_bytes + keep_free_gb * GB:
            return (f"{path} has {free / GB:.1f} GB free; the last RL iteration published {need_bytes / GB:.2f} GB "
                    f"and BATCHRL_MIN_FREE_GB keeps {keep_free_gb:g} GB free")
    return None


class IterationRoom:
    """The check `batchrl run` makes before each RL iteration: ``stop(title)`` is the line to say once the next
    iteration would not fit (then "" for every later one: skipped too), else None; ``record`` takes what an
    execution published, counting the RL loop's assets only (the first execution also builds the base model and
    the data)."""

    def __init__(self, paths: list[str], cache_dir: str, keep_free_gb: float, loop_assets: frozenset[str]):
        self.paths = [os.path.abspath(p) for p in paths if p and "://" not in p]  # this host's file systems only
        self.cache_dir, self.keep_free_gb, self.loop_assets = cache_dir, keep_free_gb, loop_assets
        self.last_bytes = 0
        self.short: str | None = None

    def stop(self, title: str) -> str | None:
        if not title.startswith("RL iteration"):
            return None
        if self.short is not None:
            return ""
        if self.last_bytes:
            self.short = shortfall(self.paths, self.last_bytes, self.keep_free_gb)
        return None if self.short is None else f"=== disk: {self.short}: no further RL iteration ({RETENTION_HINT})\n"

    def record(self, done: list[dict]) -> None:
        steps = [step for step in done if step.get("asset") in self.loop_assets]
        if steps:  # an evaluation between iterations publishes no loop asset: the estimate stays
            self.last_bytes = published_bytes(steps, self.cache_dir)
