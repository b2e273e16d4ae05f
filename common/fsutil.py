"""Filesystem helpers shared by the library: one fsspec API for local folders and s3:// prefixes.

Outputs are immutable: written to a temporary sibling and renamed (local) or sent as one PUT (S3),
so a reader never sees a half-written file and nothing is overwritten in place.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

# batchrl's records published beside a model (its lineage, training run and metrics): about the model, not
# part of it, so two folders that differ only in these hold the same model
RECORD_FILES = frozenset({"lineage.json", "batchrl_train.json", "train_metrics.json", "companions.json"})


def filesystem_for(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path-without-protocol) for a local path or an ``s3://`` URI."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def safe_name(name: str, what: str = "name") -> str:
    """``name`` as one path component under a storage root, or ValueError: asset names, data versions,
    partition keys and anything else that may come from data or config must not escape the root
    (``..``, separators, NUL, absolute paths, a drive or URL scheme)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0")
            or ":" in name or name != name.strip() or len(name) > 255):
        raise ValueError(f"unsafe {what} {name!r}: must be one plain path component (no '/', '\\', '..', ':')")
    return name


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


def move_into_place(fill, dest: str) -> None:
    """``fill(tmp)`` builds a folder next to ``dest``, then one rename makes it visible whole. Another
    process may publish the same content at the same time: its folder wins, ours is dropped (the content
    is the same: the name is its hash). A killed process leaves only a ``.tmp-`` sibling behind."""
    tmp = f"{dest}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fill(tmp)
        os.replace(tmp, dest)
    except OSError:
        if not os.path.isdir(dest):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or the whole file."""
    parent = path.rsplit("/", 1)[0]
    if is_local(fs):
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:  # object stores: a single PUT is atomic
        fs.pipe_file(path, data)


# sha256 of local files this process wrote and hashed while writing them (a trainer's export): keyed by
# (device, inode, size, mtime_ns), so a rename keeps the entry and any later change of the file drops it
_WRITTEN_SHA256: dict[tuple[int, int, int, int], str] = {}


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def note_written_sha256(path: str, digest: str) -> None:
    """Record the sha256 a writer took of the bytes it just wrote to the local file ``path`` (closed):
    ``sha256_file`` returns it without reading the file again while the file is unchanged."""
    _WRITTEN_SHA256[_identity(path)] = digest


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, block: int = 1 << 22) -> str:
    if is_local(fs) and _WRITTEN_SHA256:
        known = _WRITTEN_SHA256.get(_identity(path))
        if known is not None:
            return known
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(fs: fsspec.AbstractFileSystem, root: str, threads: int = 8) -> str:
    """Content hash of every file under ``root`` (relative names + bytes), order-independent. Files are
    hashed in ``threads`` threads (hashlib releases the GIL): a sharded model export hashes at the speed
    of several cores instead of one."""
    files = sorted(p for p in fs.find(root) if not fs.isdir(p))
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        digests = list(pool.map(lambda p: sha256_file(fs, p), files))
    return tree_hash({p[len(root.rstrip("/")) + 1:]: digest for p, digest in zip(files, digests)})


def tree_hash(file_sha256: dict[str, str]) -> str:
    """``sha256_tree`` from the sha256 of each file (relative name -> hex digest), e.g. taken by their writer."""
    h = hashlib.sha256()
    for rel in sorted(file_sha256):
        h.update(rel.encode() + b"\0" + file_sha256[rel].encode() + b"\n")
    return h.hexdigest()


def link_tree(src: str, dst: str, copy: bool = True) -> bool:
    """Put every file of the local folder ``src`` into ``dst`` as a hard link (no bytes copied: a trained
    model's export is gigabytes), copying only where linking fails (another filesystem; ``copy=False``: the
    OSError is raised instead). For our own write-once files only: both names then point at the same bytes, so
    neither may be written in place. Returns whether every file was linked (``dst`` then holds the very bytes
    ``src`` does)."""
    linked = True
    for folder, _, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(folder, src))
        os.makedirs(target, exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(folder, name), os.path.join(target, name))
            except OSError:
                if not copy:
                    raise
                shutil.copy2(os.path.join(folder, name), os.path.join(target, name))
                linked = False
    return linked


def duckdb_for(uris: list[str], storage_options: dict[str, Any] | None = None, threads: int = 2):
    """A DuckDB connection that reads ``uris`` where they are: for an object store the fsspec
    filesystem (s3fs with the given options) is registered in DuckDB (httpfs is not needed)."""
    import duckdb

    con = duckdb.connect(config={"threads": threads})
    for protocol in sorted({u.split("://", 1)[0] for u in uris if "://" in u} - {"file"}):
        fs, _ = filesystem_for(f"{protocol}://", storage_options)
        con.register_filesystem(fs)
    return con
