"""Another checkpoint's weights copied into a model that is already loaded, in place.

Evaluation compares several checkpoints of one base model (the base, its DPO and policy checkpoints):
same architecture, config and tokenizer, different weights. Copying the next checkpoint's tensors into
the loaded model's own storage skips building the model again, and the CUDA graphs an engine captured
stay valid (a graph replays on the same storage, which now holds the new weights).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from batchrl.training.models.folders import folder_key


def same_model_files(a: str, b: str) -> bool:
    """Both folders hold the same model but for its weights: config, generation config and tokenizer files
    byte-identical (batchrl's records beside a checkpoint do not count, ``folder_key``); a LoRA adapter folder
    counts as its base (its weights are the base's with the adapter merged in)."""
    from batchrl.training.models.lora import resolve_base

    a, b = resolve_base(a), resolve_base(b)
    return os.path.isdir(a) and os.path.isdir(b) and folder_key(a) == folder_key(b)


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def host_memory_available() -> int:
    """Bytes of host memory the kernel can hand out without swapping (``MemAvailable``; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The safetensors tensors of the HF folder ``path`` in host memory: each file's data read with ``readinto``
    into one buffer, the tensors views of it. Evaluation reads the next checkpoint on a thread while the GPU works
    on the current one, so the reading holds the GIL for the headers only (the read system calls release it;
    safetensors' own loader and a pinning copy slowed the decode loop ~2x on the H200). Pageable, not page-locked:
    locking a GB of pages is a CUDA driver call beside the decode loop's launches (the copy in is staged instead).
    A LoRA adapter folder: its base's weights (what ``load_checkpoint_in_place`` copies before merging it)."""
    from batchrl.training.models.lora import resolve_base

    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(resolve_base(path)):
        with open(file, "rb", buffering=0) as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            header.pop("__metadata__", None)
            size = max((entry["data_offsets"][1] for entry in header.values()), default=0)
            data = torch.empty(size, dtype=torch.uint8)
            view, done = memoryview(data.numpy()), 0
            while done < size:
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(f"{file}: {size - done} bytes of tensor data missing (truncated file)")
                done += got
        for key, entry in header.items():
            start, end = entry["data_offsets"]
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            raw = data[start:end]
            # a view needs the offset aligned to the element size (safetensors lays tensors out aligned)
            raw = raw.view(dtype) if start % dtype.itemsize == 0 else raw.clone().view(dtype)
            tensors[key] = raw.reshape(entry["shape"])
    return tensors


@torch.no_grad()
def load_weights_in_place(model: Any, path: str, tensors: dict[str, torch.Tensor] | None = None) -> bool:
    """Copy the safetensors weights of the HF folder ``path`` (``tensors``: those weights, already read by
    ``read_weights``) into ``model``'s parameters and buffers (cast to their dtype, read straight onto their
    device). Returns False, with the model untouched, when the files do not cover the model exactly (other
    names or shapes, a tensor missing that is not tied to one present): the caller then loads the folder the
    usual way."""
    from safetensors import safe_open

    files = weight_files(path)
    state = model.state_dict()
    stored: dict[str, tuple[int, ...]] = {}  # name -> shape, from the files' headers
    if tensors is not None:
        stored = {key: tuple(value.shape) for key, value in tensors.items()}
    for file in files if tensors is None else []:
        with safe_open(file, framework="pt") as f:
            stored.update((key, tuple(f.get_slice(key).get_shape())) for key in f.keys())
    if not stored or any(key not in state or tuple(state[key].shape) != shape for key, shape in stored.items()):
        return False
    # a tensor absent from the files must share its storage with one present (tied embeddings)
    present = {state[key].untyped_storage().data_ptr() for key in stored}
    if any(state[key].untyped_storage().data_ptr() not in present for key in state if key not in stored):
        return False
    if tensors is not None:
        for key, value in tensors.items():
            state[key].copy_(value)
        return True
    device = next(iter(state.values())).device
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                state[key].copy_(f.get_tensor(key))
    return True
