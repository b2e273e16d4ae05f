"""A Ray job's files through the storage root: no disk is shared between the Dagster process and the Ray nodes.

A job config names local paths (its inputs, its work dir, the files it writes). The Dagster side uploads every
path that exists under ``<prefix>/in/<i>/``; each rank downloads them into a scratch folder of its own node and
runs the job on the config with those paths rewritten; afterwards every rank uploads the files its job created
or changed under ``<prefix>/out/<i>/`` (the others first, rank 0 last, so rank 0's copy of a shared name wins),
and the Dagster side downloads them back into the original paths, each file by temp file + rename. A failed job
uploads nothing, so the Dagster side never sees half a result. A local storage root (a one-host cluster) moves the
files as hard links where it can, except into a job's scratch, which the job may change in place.

Under ``<prefix>/{in,out}/<i>/``: ``file`` for a root that is a file, ``tree/<relative path>`` for a folder.
"""
from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from batchrl.common import fsutil

# config keys naming a node's own cache (compile caches): never shipped, each node keeps its own
NODE_LOCAL_KEYS = frozenset({"compile_cache_dir"})
# a config string naming a place in the cache of whichever node runs the job (``node_cache``): made a path there
NODE_CACHE_PREFIX = "ray-node-cache:"
TRANSFER_THREADS = 8


def _strings(value: Any, key: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in NODE_LOCAL_KEYS:
                yield from _strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v, key)
    elif isinstance(value, str):
        yield value


def path_roots(*configs: dict) -> list[str]:
    """The local paths of ``configs`` that travel: absolute ones that exist or whose folder exists (a file the job
    writes), without those inside another (they travel with it)."""
    candidates = sorted({os.path.normpath(s) for c in configs for s in _strings(c)
                         if os.path.isabs(s) and (os.path.exists(s) or os.path.isdir(os.path.dirname(s)))})
    roots: list[str] = []
    for path in candidates:  # sorted: a folder comes before what it holds
        if not any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots):
            roots.append(path)
    return roots


def _map_strings(value: Any, change) -> Any:
    """``value`` with ``change`` applied to each of its strings (those under ``NODE_LOCAL_KEYS`` left as they are)."""
    if isinstance(value, dict):
        return {k: v if k in NODE_LOCAL_KEYS else _map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, change) for v in value]
    return change(value) if isinstance(value, str) else value


def rewrite_paths(value: Any, mapping: dict[str, str]) -> Any:
    """``value`` with every string under a root of ``mapping`` moved under that root's new place."""
    def moved(text: str) -> str:
        if os.path.isabs(text):
            path = os.path.normpath(text)
            for old, new in mapping.items():
                if path == old or path.startswith(old.rstrip("/") + "/"):
                    return new + path[len(old):]
        return text
    return _map_strings(value, moved)


def node_cache(relative: str) -> str:
    """A config value that becomes ``<the node's cache>/<relative>`` on the node that runs the job: a place that
    never travels (the samples an update draws ahead for the next rollouts job on its node)."""
    return NODE_CACHE_PREFIX + relative


def resolve_node_cache(value: Any, folder: str) -> Any:
    """``value`` with every ``node_cache`` string made a path under this node's cache ``folder``."""
    return _map_strings(value, lambda text: os.path.join(folder, text.removeprefix(NODE_CACHE_PREFIX))
                        if text.startswith(NODE_CACHE_PREFIX) else text)


def local_files(path: str) -> dict[str, str]:
    """``{remote relative name: local file}`` of a root: ``file`` or ``tree/<rel>``."""
    if os.path.isfile(path):
        return {"file": path}
    files = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            files["tree/" + os.path.relpath(full, path)] = full
    return files


def _link_into_place(source: str, dest: str) -> bool:
    """``dest`` made a hard link to ``source`` (temp name + rename: never written in place), or False where no link
    can be made (another file system) and the caller copies."""
    tmp = f"{dest}.tmp-{uuid.uuid4().hex}"
    try:
        os.link(source, tmp)
    except OSError:
        return False
    os.replace(tmp, dest)
    return True


def upload(fs, prefix: str, files: dict[str, str]) -> None:
    """Each local file of ``files`` to ``<prefix>/<name>`` (one PUT each: atomic on object stores). A local storage
    root (one host) gets hard links where it can: a checkpoint's gigabytes are not copied. The caller never writes
    into these files afterwards (a job's inputs before it runs, its outputs once it has ended)."""
    def put(item):
        name, local = item
        remote = fsutil.join(prefix, name)
        if fsutil.is_local(fs):  # folders first; object stores need none
            fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            if _link_into_place(local, remote):
                return
        fs.put_file(local, remote)
    with ThreadPoolExecutor(TRANSFER_THREADS) as pool:
        list(pool.map(put, files.items()))


def download(fs, prefix: str, dest: str, link: bool = False) -> int:
    """What ``upload`` put under ``prefix`` into the root ``dest`` (a file or a folder, merged into what is there),
    each file by temp file + rename; the number of files. ``link``: hard links from a local storage root where it
    can, for files nobody writes into again (a finished job's outputs; never a job's inputs, which it may change)."""
    try:
        names = [p[len(prefix.rstrip("/")) + 1:] for p in fs.find(prefix)]
    except FileNotFoundError:
        names = []
    link = link and fsutil.is_local(fs)

    def get(name: str) -> None:
        local = dest if name == "file" else os.path.join(dest, name[len("tree/"):])
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        if link and _link_into_place(fsutil.join(prefix, name), local):
            return
        tmp = f"{local}.tmp-{uuid.uuid4().hex}"
        fs.get_file(fsutil.join(prefix, name), tmp)
        os.replace(tmp, local)
    with ThreadPoolExecutor(TRANSFER_THREADS) as pool:
        list(pool.map(get, names))
    return len(names)


def snapshot(paths: list[str]) -> dict[str, tuple[int, int]]:
    """``{local file: (size, mtime_ns)}`` under ``paths``: what a job found, so that what it wrote can be told."""
    seen = {}
    for path in paths:
        if os.path.exists(path):
            for local in local_files(path).values():
                stat = os.stat(local)
                seen[local] = (stat.st_size, stat.st_mtime_ns)
    return seen


def changed_files(path: str, before: dict[str, tuple[int, int]]) -> dict[str, str]:
    """The files of root ``path`` that are new or changed since ``before``."""
    if not os.path.exists(path):
        return {}
    changed = {}
    for name, local in local_files(path).items():
        stat = os.stat(local)
        if before.get(local) != (stat.st_size, stat.st_mtime_ns):
            changed[name] = local
    return changed
