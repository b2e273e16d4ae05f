"""What a lineage record needs beyond inputs and config: code versions that follow imports, the
environment a stage ran in, the storage root's layout, and references that stay valid when a storage root
is copied or moved.

``code_version(*modules)`` hashes the source of the named ``batchrl`` modules *and every batchrl module
they import* (statically, imports inside functions included), so editing a helper such as
``training/trainer/batching.py`` changes the version of every stage that runs it, and of no other.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from typing import Any

PACKAGE = "batchrl"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root, above lineage/

# Packages whose versions decide what a stage computes (recorded when installed).
RECORDED_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "deepspeed", "vllm",
                     "dagster", "pandera", "pandas", "pyarrow", "numpy", "duckdb", "s3fs", "pydantic", "gguf")


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
# definitions: parsing ~70 files was ~0.3 s of each start on a 2-core box); keyed like the in-process cache
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


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", PACKAGE_DIR, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def environment_record() -> dict[str, Any]:
    """Packages, code checkout, Python/torch/CUDA build and devices of this process (cached)."""
    packages = {}
    for name in RECORDED_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    record: dict[str, Any] = {
        "batchrl": importlib.metadata.version("batchrl") if _installed("batchrl") else None,
        "packages": packages,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no") or ""
        record["git"] = {"commit": commit, "dirty": bool(status.strip())}
    torch_build = _torch_build()
    if torch_build is not None:
        record["torch"] = {**torch_build, "devices": _gpu_names() or ["cpu"]}
    return record


def _torch_build() -> dict[str, Any] | None:
    """torch's version and CUDA build, read from its ``version.py`` without importing torch: the Dagster
    process loads and runs data stages without torch, and importing it (and touching CUDA) to write a
    lineage record cost the first data step ~3.5 s on the GPU host. cuDNN: its wheel's version."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    values = {}
    for node in tree.body:  # `name = 'value'` / `name: Optional[str] = None`
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value
    cudnn = None
    for wheel in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            cudnn = importlib.metadata.version(wheel)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"version": values.get("__version__"), "cuda": values.get("cuda"), "cudnn": cudnn}


def _gpu_names() -> list[str]:
    """The NVIDIA GPUs' model names from the driver's /proc entries (no CUDA context, no torch)."""
    root = "/proc/driver/nvidia/gpus"
    names = []
    for bus_id in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, bus_id, "information")) as f:
                names += [line.split(":", 1)[1].strip() for line in f if line.startswith("Model:")]
        except OSError:
            continue
    return names


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def relative_to_root(value: Any, root: str) -> Any:
    """``value`` with every string under ``root`` written relative to it (dicts and lists walked)."""
    prefix = root.rstrip("/") + "/"
    if isinstance(value, str):
        return value[len(prefix):] if value.startswith(prefix) else value
    if isinstance(value, dict):
        return {k: relative_to_root(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_to_root(v, root) for v in value]
    return value


# -- the storage root's layout, derived here only --------------------------------------------------------
# <root>/<asset>/<data version>/   a published artifact (lineage.json inside)
# <root>/catalog.duckdb            the catalog (always local: beside a local root, or the local root of an s3 env)
# <root>/_cache/                   staging, downloads of an s3 root, trainer work dirs, compile caches
CATALOG_FILE = "catalog.duckdb"
CACHE_FOLDER = "_cache"
DEFAULT_ROOT = ".storage"


def local_storage_root() -> str:
    """The local storage root in use: ``BATCHRL_STORAGE``, else ``./.storage`` (absolute)."""
    return os.path.abspath(os.environ.get("BATCHRL_STORAGE", DEFAULT_ROOT))


def catalog_path_of(root: str) -> str:
    return os.path.join(root, CATALOG_FILE)


def cache_dir_of(root: str) -> str:
    return os.path.join(root, CACHE_FOLDER)


def artifact_path(asset: str, data_version: str) -> str:
    """Where an artifact lies relative to its storage root."""
    return f"{asset}/{data_version}"


def artifact_uri(root: str, asset: str, data_version: str) -> str:
    return f"{root.rstrip('/')}/{artifact_path(asset, data_version)}" if "://" in root \
        else os.path.join(root, asset, data_version)


def root_of(artifact_uri: str) -> str:
    """The storage root of a published artifact (``<root>/<asset>/<data version>``)."""
    return artifact_uri.rstrip("/").rsplit("/", 2)[0]


def rooted_uri(uri: str, asset: str, data_version: str, root: str) -> str:
    """Where the artifact recorded as ``uri`` lies under ``root``, the storage root in use now. A reference
    is its path relative to the root it was published in (lineage, catalog ``path``); an absolute one (Dagster
    event metadata, older records) is read the same way, by its ``<asset>/<data version>`` tail, so a root
    copied or moved with its Dagster home resolves to itself and never to the original. Anything else is
    no artifact of a storage root: refused (refs travel through Dagster and JSON)."""
    tail = artifact_path(asset, data_version)
    recorded = uri.rstrip("/")
    if recorded != tail and not recorded.endswith("/" + tail):
        raise ValueError(f"artifact {uri!r} is outside the storage root {root!r} (not <root>/{tail})")
    return artifact_uri(root, asset, data_version)


def input_uri(entry: dict, consumer_uri: str) -> str:
    """Where an input recorded in the lineage of the artifact at ``consumer_uri`` lies: in the same root."""
    return rooted_uri(entry["uri"], entry["asset"], entry["data_version"], root_of(consumer_uri))
