"""Code versions that follow imports.

``code_version(*modules)`` hashes the source of the named ``batchrl`` modules *and every batchrl module
they import* (statically, imports inside functions included), so editing a helper such as
``training/trainer/batching.py`` changes the version of every stage that runs it, and of no other.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
from typing import Any

from batchrl.common.package import PACKAGE, PACKAGE_DIR


def module_file(name: str) -> str | None:
    """The source file of a batchrl module (``pkg/__init__.py`` for a package), or None if there is none."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = os.path.join(PACKAGE_DIR, *parts[1:])
    for candidate in (os.path.join(base, "__init__.py"), base + ".py"):
        if os.path.isfile(candidate):
            return candidate
    return None


def _package_modules(name: str) -> list[str]:
    """A package and every module below it (what naming a package in ``code_version`` means)."""
    root = os.path.join(PACKAGE_DIR, *name.split(".")[1:])
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        rel = os.path.relpath(folder, PACKAGE_DIR)
        prefix = PACKAGE if rel == "." else f"{PACKAGE}.{rel.replace(os.sep, '.')}"
        out += [prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}" for f in sorted(files) if f.endswith(".py")]
    return out


# _parsed_imports across processes (each of the CLI, the step server and the UI's code server builds the
# definitions, and parsing every module again was a visible part of each start); keyed like the in-process cache
IMPORTS_CACHE = os.path.join(PACKAGE_DIR, "__pycache__", "batchrl-imports.json")
_disk_cache: dict[str, list] | None = None
_disk_cache_dirty = False


def _imported_names(path: str, module: str) -> set[str]:
    """batchrl modules ``path`` imports, anywhere in the file (relative imports resolved)."""
    global _disk_cache, _disk_cache_dirty
    if _disk_cache is None:
        try:
            with open(IMPORTS_CACHE) as f:
                _disk_cache = json.load(f)
        except (OSError, ValueError):
            _disk_cache = {}
    st = os.stat(path)
    key, stamp = f"{module}\0{path}", [st.st_mtime_ns, st.st_size]
    entry = _disk_cache.get(key)
    if entry is not None and entry[:2] == stamp:
        return frozenset(entry[2])
    names = _parsed_imports(path, module, st.st_mtime_ns, st.st_size)
    _disk_cache[key], _disk_cache_dirty = [*stamp, sorted(names)], True
    return names


def _save_imports_cache() -> None:
    """Write the parsed imports for the next process (atomically: processes start side by side); a package
    folder that cannot be written just keeps parsing."""
    global _disk_cache_dirty
    if not _disk_cache_dirty:
        return
    tmp = f"{IMPORTS_CACHE}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(IMPORTS_CACHE), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(_disk_cache, f)
        os.replace(tmp, IMPORTS_CACHE)
        _disk_cache_dirty = False
    except OSError:
        pass


@functools.lru_cache(maxsize=None)
def _parsed_imports(path: str, module: str, mtime_ns: int, size: int) -> frozenset[str]:
    """``_imported_names`` of one version of the file (the stat fields key it): every asset's
    ``code_version`` walks the shared helpers again, and parsing them each time made up most of the
    definitions' import time (~1.6 s of 1.9 s for the asset modules on a 2-core box)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = path.endswith("__init__.py")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return frozenset(n for n in names if n == PACKAGE or n.startswith(PACKAGE + "."))


def module_closure(*modules: str) -> list[str]:
    """The named modules (a package stands for all its modules), every batchrl module they import,
    transitively, and the parent packages each import executes."""
    pending = [m for name in modules for m in (_package_modules(name) if module_file(name) and
                                                module_file(name).endswith("__init__.py") else [name])]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None:
            continue  # an attribute (`from batchrl.x import some_function`), not a module
        seen.add(name)
        parts = name.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]
        pending += sorted(_imported_names(path, name))
    _save_imports_cache()
    return sorted(seen)


def code_version(*modules: str, config: Any = None) -> str:
    """Hash of the source of the modules a stage runs (import closure) plus its config schema."""
    for name in modules:
        if module_file(name) is None:
            raise ImportError(f"code_version: module {name} not found under {PACKAGE_DIR}")
    digest = hashlib.sha256()
    for name in module_closure(*modules):
        with open(module_file(name), "rb") as f:
            digest.update(f"{name}\0".encode() + f.read() + b"\0")
    if config is not None:
        schema = config.model_json_schema() if hasattr(config, "model_json_schema") else repr(config)
        digest.update(json.dumps(schema, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:12]
