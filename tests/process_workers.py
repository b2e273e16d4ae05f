"""What the concurrency tests run in their worker processes: a module that imports only the resources it
uses, because spawned workers import the module of the function they run."""
from __future__ import annotations

import multiprocessing
import os
import signal

from batchrl.resources import CatalogResource, StorageResource


def in_processes(fn, items: list) -> list:
    """``fn`` over ``items``, one spawned process each, all at once. Spawned, not forked: a fork of the
    multi-threaded pytest worker can copy a lock another thread holds. Closed and joined, not terminated: in a
    worker where SIGTERM is ignored (Dagster gives SIGTERM the SIGINT disposition, and a shell's background job
    ignores SIGINT) ``Pool.terminate`` waited forever on a child (CI stalled); children get SIGTERM back."""
    pool = multiprocessing.get_context("spawn").Pool(len(items), initializer=signal.signal,
                                                     initargs=(signal.SIGTERM, signal.SIG_DFL))
    try:
        return pool.map(fn, items)
    finally:
        pool.close()
        pool.join()


def publish_same(args) -> str:
    root, staging = args
    ref = StorageResource(root=root, cache_dir=os.path.join(root, "_cache")).publish(staging, "asset", {"k": 1})
    return ref.uri


def record_many(args) -> int:
    path, worker, n = args
    catalog = CatalogResource(path=path)
    for i in range(n):
        catalog.record(asset=f"w{worker}", data_version=f"{i:04d}", uri=f"/x/{worker}/{i}", run_id=f"run-{worker}",
                       code_version="c", metadata={"i": i, "worker": worker})
    return n
