"""A Ray job's published inputs read from the storage root where they already are, kept on each node for later jobs.

A job's config names local folders; those that are published artifacts (a folder ``<asset>/<data version>`` holding
its ``lineage.json``, as ``StorageResource.localize`` lays them out) already lie complete under the storage root the
nodes read. The Dagster side uploads nothing for them (``artifact_sources``); each node downloads such an artifact
once into its input cache and every later job on that node reads it from there (``NodeInputCache``): the model a
reference pass, the rollouts and the update of an RL iteration all read is fetched once per node, not uploaded and
downloaded once per job. A data version names its content, so a cached copy never goes stale; the least recently
used entries beyond ``BATCHRL_RAY_INPUT_CACHE_ENTRIES`` are dropped. Jobs read these folders and never write into
them (what a job writes goes into its work dir, uploaded as before: ``resources/ray_staging.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from batchrl.common import fsutil
from batchrl.common.environment_variables import read
from batchrl.common.storage_layout import artifact_path

# under the input cache, what jobs on this node leave for later jobs on it (``ray_staging.node_cache``); no asset name
# starts with a dot
NODE_OWN = ".node"
NODE_OWN_STALE_S = 3600.0
# <node own>/produced/<data version>: hard links to an output a job on this node hashed, for the later jobs here that
# read it once it is published (the update's new policy: the next rollouts and update); the newest few are kept
PRODUCED = "produced"
PRODUCED_KEPT = 2
PRODUCED_MIN_BYTES = 1 << 20  # smaller files (records, configs, the reports publication adds) are downloaded
LINEAGE_FILE = "lineage.json"  # resources/storage.py: written last, so its presence marks a complete artifact


def artifact_sources(roots: list[str], fs, base: str) -> dict[int, str]:
    """``{index of a root: its artifact's folder under the storage root}`` for the roots that are published
    artifacts complete there (``base``: the storage root as ``fs`` names it)."""
    found = {}
    for i, root in enumerate(roots):
        try:
            with open(os.path.join(root, LINEAGE_FILE)) as f:
                lineage = json.load(f)
            asset, version = lineage["asset"], lineage["data_version"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if os.path.basename(os.path.normpath(root)) != version:  # not an artifact's own folder (a copy of its record)
            continue
        remote = fsutil.join(base, artifact_path(asset, version))
        if fs.exists(fsutil.join(remote, LINEAGE_FILE)):
            found[i] = remote
    return found


class NodeInputCache:
    """This node's copies of published artifacts, ``<folder>/<asset>/<data version>``, each downloaded once."""

    def __init__(self, folder: str | None = None, entries: int | None = None):
        self.folder = folder or read("BATCHRL_RAY_INPUT_CACHE_DIR") or \
            os.path.join(tempfile.gettempdir(), "batchrl-ray-inputs")
        self.entries = entries or read("BATCHRL_RAY_INPUT_CACHE_ENTRIES")
        self.fetched = self.reused = self.produced = 0

    def node_folder(self) -> str:
        """Where ``ray_staging.node_cache`` values point on this node; what lies there an hour untouched goes."""
        folder = os.path.join(self.folder, NODE_OWN)
        os.makedirs(folder, exist_ok=True)
        for kind in os.listdir(folder):  # <kind>/<entry>: e.g. rollout_prefetch/<request>
            for entry in os.listdir(os.path.join(folder, kind)) if os.path.isdir(os.path.join(folder, kind)) else ():
                path = os.path.join(folder, kind, entry)
                if time.time() - os.path.getmtime(path) > NODE_OWN_STALE_S:
                    shutil.rmtree(path, ignore_errors=True)
        return folder

    def local(self, fs, remote: str) -> str:
        """The local folder of the artifact at ``remote`` (downloaded unless this node has it), marked as used."""
        asset, version = remote.rstrip("/").split("/")[-2:]
        version = fsutil.safe_name(version, "data version")
        path = os.path.join(self.folder, fsutil.safe_name(asset, "asset name"), version)
        produced = os.path.join(self.folder, NODE_OWN, PRODUCED, version)
        if os.path.isdir(path):
            self.reused += 1
        elif os.path.isdir(produced):  # written here: its big files linked, the rest downloaded
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fsutil.move_into_place(lambda tmp: _assemble(fs, remote, produced, tmp), path)
            shutil.rmtree(produced, ignore_errors=True)  # its files live on in the copy
            self.produced += 1
        else:
            # as the storage localizes an artifact: a temp folder, one rename (two ranks of a node: the first wins)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fsutil.move_into_place(lambda tmp: fs.get(remote, tmp, recursive=True), path)
            self.fetched += 1
        os.utime(path)  # the least recently used go first
        self._evict(keep=path)
        return path

    def keep_produced(self, folder: str, content_hash: str) -> None:
        """Hard links to ``folder``, the output a job on this node just wrote and hashed (``content_hash``): once
        it is published as ``<asset>/<content_hash[:16]>``, a later job here that reads it builds its copy from
        them. Where no hard link can be made (another file system) nothing is kept: the later job downloads."""
        store = os.path.join(self.node_folder(), PRODUCED)
        target = os.path.join(store, fsutil.safe_name(content_hash[:16], "data version"))
        if os.path.isdir(target) or not os.path.isdir(folder):
            return
        try:
            os.makedirs(store, exist_ok=True)
            fsutil.move_into_place(lambda tmp: fsutil.link_tree(folder, tmp, copy=False), target)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
            return
        kept = sorted((os.path.join(store, v) for v in os.listdir(store) if ".tmp-" not in v),
                      key=os.path.getmtime, reverse=True)
        for old in kept[PRODUCED_KEPT:]:
            shutil.rmtree(old, ignore_errors=True)

    def _evict(self, keep: str) -> None:
        entries = []
        for asset in os.listdir(self.folder):
            if asset == NODE_OWN:
                continue
            folder = os.path.join(self.folder, asset)
            entries += [os.path.join(folder, v) for v in os.listdir(folder) if ".tmp-" not in v]
        entries.sort(key=lambda p: os.stat(p).st_mtime if os.path.exists(p) else time.time(), reverse=True)
        for stale in entries[self.entries:]:
            if stale != keep:
                shutil.rmtree(stale, ignore_errors=True)


def _assemble(fs, remote: str, produced: str, tmp: str) -> None:
    """The published artifact at ``remote`` in ``tmp``: each big file linked from ``produced`` where that holds it
    (same relative path and size: the data version is the hash of the files the job wrote, so their content is
    the same), every other file (``lineage.json``, the reports publication adds) downloaded."""
    base = remote.rstrip("/")
    for name, info in fs.find(base, detail=True).items():
        relative = name[len(base):].lstrip("/")
        local, copy = os.path.join(produced, relative), os.path.join(tmp, relative)
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        size = info.get("size") or 0
        if size >= PRODUCED_MIN_BYTES and os.path.isfile(local) and os.path.getsize(local) == size:
            os.link(local, copy)
        else:
            fs.get(name, copy)
