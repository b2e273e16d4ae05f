"""Artifact storage: a local folder or an s3:// prefix, chosen by config.

Every asset builds its output in a local staging folder, then `publish` moves it to
``<root>/<asset>/<content-hash>/``. The folder name is the data version, so an output is never
overwritten and an old checkpoint's inputs stay where its lineage says they are.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import dagster as dg
from pydantic import Field

from batchrl.common import fsutil
from batchrl.common.storage_layout import DEFAULT_ROOT, artifact_uri, cache_dir_of, rooted_uri
from batchrl.common.expired import MARKER, read_marker
from batchrl.resources.retention import raise_if_expired

LINEAGE_FILE = "lineage.json"


@dataclass(frozen=True)
class ArtifactRef:
    """Pointer to a published artifact folder; this is what flows between assets."""

    asset: str
    uri: str
    data_version: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _take(staging: str, tmp: str) -> None:
    """Move a finished staging folder to ``tmp`` (one rename on the same filesystem: no copy of a
    large artifact), else copy it. Publishing is the staging folder's last use."""
    try:
        os.rename(staging, tmp)
    except OSError:  # another filesystem
        shutil.copytree(staging, tmp)


class StorageResource(dg.ConfigurableResource):
    """Where artifacts live. ``root`` is a local folder or ``s3://bucket/prefix``."""

    root: str = Field(DEFAULT_ROOT, description="where artifacts live, each version under "
                      "<root>/<asset>/<content hash>/: a local folder or s3://bucket/prefix")
    storage_options: dict[str, Any] = Field({}, description="fsspec options (endpoint, credentials) for an s3:// "
                                            "root; credentials are redacted in lineage")
    cache_dir: str = Field(cache_dir_of(DEFAULT_ROOT), description="local folder where artifacts of a remote root "
                           "are downloaded once, and the trainers' resumable work folders (_work) live")

    def _fs(self):
        return fsutil.filesystem_for(self.root, self.storage_options)

    def is_local(self) -> bool:
        return fsutil.is_local(self._fs()[0])

    @contextlib.contextmanager
    def staging_dir(self, asset: str) -> Iterator[str]:
        """A fresh local folder to build an artifact in; removed afterwards."""
        base = os.path.abspath(os.path.join(self.cache_dir, "_staging"))
        os.makedirs(base, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"{fsutil.safe_name(asset, 'asset name')}-", dir=base)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def publish(self, local_dir: str, asset: str, lineage: dict[str, Any],
                sidecars: dict[str, dict] | None = None, content_hash: str | None = None) -> ArtifactRef:
        """Content-address ``local_dir`` and move it under the storage root.

        The hash covers the data files only: ``lineage.json`` and the ``sidecars`` (JSON reports with
        timings and paths) are written after hashing, so the same data gives the same version.
        ``content_hash``: ``fsutil.sha256_tree`` of these very files, taken by whoever wrote them (a trainer
        job hashes its export; the staging folder holds hard links to it), so gigabytes are not read twice."""
        fsutil.safe_name(asset, "asset name")
        for name in sidecars or {}:
            fsutil.safe_name(name, "sidecar name")
        local_fs = fsutil.filesystem_for(local_dir)[0]
        data_version = (content_hash or fsutil.sha256_tree(local_fs, os.path.abspath(local_dir)))[:16]
        for name, content in (sidecars or {}).items():
            with open(os.path.join(local_dir, name), "w") as f:
                json.dump(content, f, indent=2, sort_keys=True, default=str)
        with open(os.path.join(local_dir, LINEAGE_FILE), "w") as f:
            json.dump({**lineage, "asset": asset, "data_version": data_version}, f, indent=2, sort_keys=True)
        fsutil.safe_name(data_version, "data version")
        fs, _ = self._fs()
        uri = artifact_uri(self.root_uri(), asset, data_version)
        dest = uri.split("://", 1)[1] if "://" in uri else uri
        # an expired version (retention deleted its data files, resources.retention) published again is restored
        if self.is_local():
            if read_marker(fs, dest) is not None:  # the remnant (records, marker) makes way for the whole folder
                trash = f"{dest}.expired-{os.getpid()}"
                os.rename(dest, trash)
                shutil.rmtree(trash)
            if not os.path.exists(dest):  # same content already published: keep the first copy
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                fsutil.move_into_place(lambda tmp: _take(local_dir, tmp), dest)
            return ArtifactRef(asset=asset, uri=uri, data_version=data_version)
        complete = fs.exists(fsutil.join(dest, LINEAGE_FILE))
        expired = complete and read_marker(fs, dest) is not None
        if expired or not complete:
            # lineage.json is uploaded last: its presence marks a complete artifact (a restored one: the marker's
            # removal, after it)
            for name in sorted(os.listdir(local_dir)):
                if name != LINEAGE_FILE:
                    fs.put(os.path.join(local_dir, name), fsutil.join(dest, name), recursive=True)
            fs.put(os.path.join(local_dir, LINEAGE_FILE), fsutil.join(dest, LINEAGE_FILE))
            if expired:
                fs.rm(fsutil.join(dest, MARKER))
                shutil.rmtree(self.cached_path(asset, data_version), ignore_errors=True)  # a remnant's copy
            self._keep_as_cached(local_dir, asset, data_version)
        return ArtifactRef(asset=asset, uri=uri, data_version=data_version)

    def cached_path(self, asset: str, data_version: str) -> str:
        """This host's copy of an artifact of an s3:// root (there or not)."""
        return os.path.abspath(os.path.join(self.cache_dir, asset, data_version))

    def _keep_as_cached(self, local_dir: str, asset: str, data_version: str) -> None:
        """What was just uploaded, as this host's cached copy (one rename): the asset that reads it next (the next
        RL step reads each new checkpoint) does not download it again. Only an upload of ours: where the same
        content was published before, its ``lineage.json`` is the first publisher's, and a download gets that."""
        local = self.cached_path(asset, data_version)
        if not os.path.exists(local):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fsutil.move_into_place(lambda tmp: _take(local_dir, tmp), local)

    def locate(self, ref: ArtifactRef | dict) -> ArtifactRef:
        """``ref`` with its uri under this root (``lineage.rooted_uri``: a copied root reads its own copy)."""
        ref = ref if isinstance(ref, ArtifactRef) else ArtifactRef(**ref)
        fsutil.safe_name(ref.asset, "asset name")  # refs travel through Dagster and JSON: check, then trust
        fsutil.safe_name(ref.data_version, "data version")
        return ArtifactRef(ref.asset, rooted_uri(ref.uri, ref.asset, ref.data_version, self.root_uri()),
                           ref.data_version)

    def localize(self, ref: ArtifactRef | dict, expired_ok: bool = False) -> str:
        """A local folder holding the artifact (for S3 roots: downloaded once into the cache, or the copy this host
        uploaded). An expired artifact (``resources.retention``) is refused, naming it, unless ``expired_ok`` (its
        records are read: lineage, audit)."""
        ref = self.locate(ref)
        if self.is_local():
            path = self._inside_root(ref.uri)
            if not expired_ok:
                raise_if_expired(self._fs()[0], path)
            return path
        local = self.cached_path(ref.asset, ref.data_version)
        if not os.path.exists(local):
            fs, remote = self._fs()[0], ref.uri.split("://", 1)[1]
            if not expired_ok:  # asked before the download: an expired one is not fetched
                raise_if_expired(fs, remote)
            fsutil.move_into_place(lambda tmp: fs.get(remote, tmp, recursive=True), local)
        elif not expired_ok:  # a copy downloaded after the expiry holds the marker (one expired here was deleted)
            raise_if_expired(fsutil.filesystem_for(local)[0], local)
        return local

    def artifact_location(self, ref: ArtifactRef | dict) -> tuple[Any, str]:
        """``(file system, path)`` of ``ref``'s folder under this root: a local folder, or the bucket path of an
        s3:// root (what retention deletes from)."""
        uri = self.locate(ref).uri
        return self._fs()[0], uri.split("://", 1)[1] if "://" in uri else self._inside_root(uri)

    def root_uri(self) -> str:
        """The root as artifact uris start: an absolute folder, or ``s3://bucket/prefix``."""
        return os.path.abspath(self.root) if self.is_local() else self.root.rstrip("/")

    def _inside_root(self, uri: str) -> str:
        root = os.path.realpath(self.root)
        path = os.path.realpath(uri)
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"artifact {uri!r} is outside the storage root {self.root!r}")
        return uri

    def read_lineage(self, ref: ArtifactRef | dict) -> dict[str, Any]:
        """``lineage.json`` of ``ref`` with its input uris absolute under this root (stored relative to it)."""
        with open(os.path.join(self.localize(ref, expired_ok=True), LINEAGE_FILE)) as f:
            lineage = json.load(f)
        for entry in lineage.get("inputs", {}).values():
            entry["uri"] = self.locate(entry).uri
        return lineage
