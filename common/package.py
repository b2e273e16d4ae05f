"""The package's own files: where they lie, and a fingerprint of their source (standard library only: the thin
``batchrl`` client imports it)."""
from __future__ import annotations

import hashlib
import os

PACKAGE = "batchrl"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root, above common/


def code_fingerprint(package_dir: str) -> str:
    """Size and mtime of every source file of the package: an edited or upgraded batchrl gets a server (or job
    worker) of its own instead of a warm one still running the old code (which lineage's code versions would
    not show)."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if os.path.exists(os.path.join(folder, d, "__init__.py")))  # packages only
        for name in sorted(f for f in files if f.endswith(".py")):
            stat = os.stat(os.path.join(folder, name))
            h.update(f"{os.path.relpath(os.path.join(folder, name), package_dir)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return h.hexdigest()
