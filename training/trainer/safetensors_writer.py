"""A model export's shards written by several threads at once and hashed while they are written.

``save_pretrained`` writes its shards one after the other with ``safetensors.save_file``, which holds
the GIL for the whole shard; the job then read every byte again to hash the export (a 0.5B model's
fp32 export: 2 GB, ~2.3 s to write + 0.5-2 s to hash on an H200 host). ``write_safetensors`` writes
the same format (8-byte little-endian header length, JSON header padded to 8 bytes, then each tensor's
bytes in header order) with work that releases the GIL (device-to-host copy, file write, sha256), and
records each file's sha256 (``fsutil.note_written_sha256``) so the job's content hash does not read it.
``parallel_shard_writes`` lets ``save_pretrained`` keep everything else (tied weights, the shard
split, the index, the config) while its shard writes go to a thread pool.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from batchrl.common import fsutil

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, on the host (a device tensor is copied, the GIL released)."""
    host = tensor.detach().to("cpu").contiguous()
    return host.reshape(-1).view(torch.uint8).numpy().data


def write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` to ``path`` in the safetensors format; returns (and records) the file's sha256.
    Larger elements first, then by name (safetensors' own order: every tensor stays aligned)."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(encoded)), encoded):
            digest.update(part)
            f.write(part)
        for name in order:
            data = _host_bytes(tensors[name])
            digest.update(data)
            f.write(data)
    sha = digest.hexdigest()
    fsutil.note_written_sha256(path, sha)
    return sha


@contextlib.contextmanager
def parallel_shard_writes(threads: int = 8) -> Iterator[None]:
    """Inside the block, ``save_pretrained``'s shard writes go to ``threads`` threads running
    ``write_safetensors``; leaving the block waits for them and raises the first error. Without the hook
    (another transformers layout) the block runs unchanged: shards written by safetensors, hashed later."""
    from transformers import modeling_utils

    original = getattr(modeling_utils, "safe_save_file", None)
    if original is None:
        yield
        return
    pending: list[Future] = []
    with ThreadPoolExecutor(threads, thread_name_prefix="export") as pool:
        def submit(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
            pending.append(pool.submit(write_safetensors, dict(tensors), str(filename), metadata))

        modeling_utils.safe_save_file = submit
        try:
            yield
        finally:
            modeling_utils.safe_save_file = original
            errors = [f.exception() for f in pending]  # waits for every write, also when the block failed
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
