"""What the concurrency tests run in their worker processes: a module that imports only the resources it
uses, because spawned workers import the module of the function they run."""
from __future__ import annotations

import os

from batchrl.resources import CatalogResource, StorageResource


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
