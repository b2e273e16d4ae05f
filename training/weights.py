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

from batchrl.training.tiny_model import folder_key


def same_model_files(a: str, b: str) -> bool:
    """Both folders hold the same model but for its weights: config, generation config and tokenizer files
    byte-identical (batchrl's records beside a checkpoint do not count, ``folder_key``)."""
    return os.path.isdir(a) and os.path.isdir(b) and folder_key(a) == folder_key(b)


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else []


@torch.no_grad()
def load_weights_in_place(model: Any, path: str) -> bool:
    """Copy the safetensors weights of the HF folder ``path`` into ``model``'s parameters and buffers
    (cast to their dtype, read straight onto their device). Returns False, with the model untouched, when
    the files do not cover the model exactly (other names or shapes, a tensor missing that is not tied
    to one present): the caller then loads the folder the usual way."""
    from safetensors import safe_open

    files = _weight_files(path)
    state = model.state_dict()
    stored: dict[str, tuple[int, ...]] = {}  # name -> shape, from the files' headers
    for file in files:
        with safe_open(file, framework="pt") as f:
            stored.update((key, tuple(f.get_slice(key).get_shape())) for key in f.keys())
    if not files or any(key not in state or tuple(state[key].shape) != shape for key, shape in stored.items()):
        return False
    # a tensor absent from the files must share its storage with one present (tied embeddings)
    present = {state[key].untyped_storage().data_ptr() for key in stored}
    if any(state[key].untyped_storage().data_ptr() not in present for key in state if key not in stored):
        return False
    device = next(iter(state.values())).device
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                state[key].copy_(f.get_tensor(key))
    return True
