"""The environment a stage ran in, for its lineage record: packages, code checkout, Python, torch/CUDA build and
devices, read without importing torch or touching CUDA."""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from typing import Any

from batchrl.common.package import PACKAGE_DIR

# Packages whose versions decide what a stage computes (recorded when installed).
RECORDED_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "deepspeed", "vllm",
                     "dagster", "pandera", "pandas", "pyarrow", "numpy", "duckdb", "s3fs", "pydantic", "gguf")


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
