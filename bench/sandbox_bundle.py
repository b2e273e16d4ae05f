"""The GPU bundle's sandbox part: Debian's bubblewrap binary (with its sha256), libseccomp and the wheels the
sandbox and its escape suite need on the GPU host, which has no bubblewrap and reaches no package registry.

    .venv/bin/python bench/sandbox_bundle.py          # here: stage, then bench/carry.py packs .carry/sandbox/
    # on the device (one call; see bench/bench_sandbox_gpu.sh):
    bash bench/bench_sandbox_gpu.sh                   # carry: [".carry/sandbox/part-000"]

The binary is ``/usr/bin/bwrap`` of this machine's Debian package ``bubblewrap`` (``dpkg -s`` version recorded);
``bwrap.sha256`` beside it is what ``training/sandbox/levels.py`` checks when ``BATCHRL_BWRAP`` points at the copy:
a binary that differs is refused, not run. Its libraries (libc, libselinux, libcap) are on the GPU host already
(checked 2026-12-05); libseccomp.so.2 travels for ``pyseccomp`` in case the host lacks it.
"""
from __future__ import annotations

import ctypes.util
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE = os.path.join(REPO, ".carry", "sandbox-stage")
WHEELS = ("pyseccomp", "pytest", "iniconfig", "pluggy", "packaging", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "typing-extensions")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stage_binaries() -> list[str]:
    """bwrap + bwrap.sha256 + libseccomp.so.2 in the staging folder; their paths."""
    os.makedirs(STAGE, exist_ok=True)
    bwrap = os.path.join(STAGE, "bwrap")
    shutil.copy2("/usr/bin/bwrap", bwrap)
    with open(bwrap + ".sha256", "w") as f:
        f.write(f"{sha256(bwrap)}  bwrap\n")
    version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "bubblewrap"], capture_output=True, text=True)
    with open(os.path.join(STAGE, "bwrap.version"), "w") as f:
        f.write(f"Debian bubblewrap {version.stdout.strip() or '?'}\n")
    library = os.path.join(STAGE, "libseccomp.so.2")
    found = ctypes.util.find_library("seccomp")
    source = next((os.path.join(d, found) for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu")
                   if found and os.path.exists(os.path.join(d, found))), None)
    if source is None:
        sys.exit("libseccomp.so.2 not found here: apt-get install libseccomp2")
    shutil.copyfile(os.path.realpath(source), library)
    return [bwrap, bwrap + ".sha256", os.path.join(STAGE, "bwrap.version"), library]


def main() -> None:
    files = stage_binaries()
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    cmd = [sys.executable, os.path.join(REPO, "bench", "carry.py"), "prepare", "sandbox", "--requirements", *specs]
    for path in files:
        cmd += ["--file", path]
    subprocess.run(cmd, check=True, cwd=REPO)
    print(f"bwrap sha256 {sha256(files[0])}; carry .carry/sandbox/part-000 and run bash bench/bench_sandbox_gpu.sh")


if __name__ == "__main__":
    main()
