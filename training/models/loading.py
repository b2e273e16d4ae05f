"""Loading any Hugging Face causal-LM folder (the tiny default, an export, a hub or GGUF-converted model) and its
tokenizer, through the worker's weight and tokenizer caches: ``load_model_and_tokenizer``, ``load_pretrained``,
``load_checkpoint_in_place``.
"""
from __future__ import annotations

import contextlib
import copy
import os
from collections import OrderedDict
from typing import Any

import torch

from batchrl.training.models.folders import folder_key
from batchrl.training.timing.phases import phase


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` or a torch dtype -> torch dtype."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def placed_on(device: str | torch.device) -> dict[str, Any]:
    """``from_pretrained`` keywords that load the weights onto ``device``: straight onto an accelerator
    (read from the file, cast there: no host-side cast of a 2 GB fp32 export and no second copy); on the
    CPU the default loading (then ``.to(device)`` is a no-op)."""
    return {} if torch.device(device).type == "cpu" else {"device_map": str(device)}


# Loaded tokenizers of this process, by the content of their folder's tokenizer files: a long-lived job
# worker parses a 150k-vocabulary tokenizer.json (slow) once, not once per stage and model;
# exported checkpoints and the reward model carry identical tokenizer files, so they share the entry.
_TOKENIZERS: OrderedDict[str, Any] = OrderedDict()
TOKENIZER_CACHE_SIZE = 4


def tokenizer_key(path: str) -> str:
    """What identifies a folder's tokenizer: its tokenizer files' key, or the name for a hub id (a LoRA adapter:
    its base's)."""
    from batchrl.training.models.lora import resolve_base

    path = resolve_base(path)
    return folder_key(path, tokenizer_only=True) if os.path.isdir(path) else path


def _own_copy(tokenizer: Any) -> Any:
    """A copy whose settings (padding side, special tokens ...) are its own; the parsed vocabulary (the
    Rust tokenizer, reconfigured by every call for its padding/truncation) is shared."""
    twin = copy.copy(tokenizer)
    for name, value in vars(tokenizer).items():
        if isinstance(value, (dict, list, set)):
            setattr(twin, name, copy.copy(value))
    return twin


def load_tokenizer(path: str):
    """Tokenizer of any HF folder, left-padded, with a pad token (falls back to eos). Loaded once per
    process for the same tokenizer files; each caller gets its own copy to configure."""
    from transformers import AutoTokenizer

    from batchrl.training.models.lora import resolve_base

    path = resolve_base(path)  # a LoRA adapter folder: its base's tokenizer (the adapter carries none)
    key = tokenizer_key(path) if os.path.isdir(path) else None  # a hub id is not cached: its files may change
    if key is not None and key in _TOKENIZERS:
        _TOKENIZERS.move_to_end(key)
        return _own_copy(_TOKENIZERS[key])
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if key is not None:
        _TOKENIZERS[key] = tokenizer
        while len(_TOKENIZERS) > TOKENIZER_CACHE_SIZE:
            _TOKENIZERS.popitem(last=False)
        return _own_copy(tokenizer)
    return tokenizer


def _weight_cache_key(path: str, dtype: torch.dtype, device: str, kind: str = "causal_lm") -> tuple | None:
    """The folder's key in the weight cache (``training/models/weight_cache.py``), None when the cache is off or the
    folder is not cacheable (a hub id, no safetensors weights, ZeRO-3's partitioned construction)."""
    from batchrl.training.models import weight_cache

    if not weight_cache.enabled() or not os.path.isdir(path):
        return None
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from batchrl.training.models.weights import weight_files

    if is_deepspeed_zero3_enabled():
        return None
    others = tuple(os.path.join(path, name) for name in
                   ("model.safetensors.index.json", "config.json", "generation_config.json"))
    return weight_cache.key(weight_files(path), dtype=dtype, device=device, kind=kind, other_files=others)


def _empty_model(entry: Any, auto_class: Any, dtype: torch.dtype, device: str):
    """The cached model's architecture built straight on ``device`` from the loaded model's config, its weights
    left uninitialised (they are copied in next): no file is read."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: the random init runs, then is overwritten
        no_init_weights = contextlib.nullcontext
    with torch.device(device), no_init_weights():
        model = auto_class.from_config(copy.deepcopy(entry.extras["config"]), dtype=dtype)
    model.tie_weights()  # part of the init that no_init_weights skips (tied embeddings: one tensor again)
    if "generation_config" in entry.extras:
        model.generation_config = copy.deepcopy(entry.extras["generation_config"])
    return model.eval()


def _uncovered(model: Any, path: str) -> list[str]:
    """The tensors of ``model`` that the folder's weight files do not hold (a tied one counts through its twin):
    the load initialised them at random (e.g. a new classification head on a base model), and a cached copy
    would hand the next load this load's random values instead of its own."""
    from safetensors import safe_open

    from batchrl.training.models.weights import weight_files

    names: set[str] = set()
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    state = model.state_dict()
    stored = {state[k].untyped_storage().data_ptr() for k in names if k in state}
    return [k for k, v in state.items() if k not in names and v.untyped_storage().data_ptr() not in stored]


def _merged_cache_key(path: str, dtype: torch.dtype, device: str, kind: str) -> tuple | None:
    """The weight-cache key of an adapter folder's merged model where it is worth keeping: an adapter that
    replaces modules (a reward model's or critic's head, ``modules_to_save``) on a base folder that is no adapter
    itself. Plain LoRA adapters are merged in place into their cached base by the engines
    (``load_checkpoint_in_place``): a merged copy of each would only evict that base."""
    from batchrl.training.models import lora
    from batchrl.training.models import weight_cache

    if not weight_cache.enabled() or lora.merges_in_place(path):
        return None
    base = lora.adapter_base(path)
    base_key = _weight_cache_key(base, dtype, device, kind) if not lora.is_adapter_folder(base) else None
    adapter_key = weight_cache.key([os.path.join(path, lora.ADAPTER_WEIGHTS)], dtype=dtype, device=device,
                                   kind="adapter", other_files=(os.path.join(path, lora.ADAPTER_CONFIG),))
    return None if base_key is None or adapter_key is None else ("merged", base_key, adapter_key)


def _merged_covered(model: Any, adapter_path: str) -> bool:
    """Every tensor of the merged ``model`` comes from files: its base's, or a module the adapter replaces."""
    from batchrl.training.models import lora

    replaced = tuple(lora.read_adapter_config(adapter_path).get("modules_to_save") or ())
    return all(any(f".{m}." in f".{name}" for m in replaced)
               for name in _uncovered(model, lora.adapter_base(adapter_path)))


def load_pretrained(path: str, auto_class: Any, *, dtype: torch.dtype | str, device: str, kind: str,
                    **load_kwargs: Any):
    """``auto_class.from_pretrained(path, ...)`` on ``device`` in eval mode; where the weight cache is on (the job
    worker), a folder loaded before with the same files, dtype, device and ``kind`` is built from the cached
    weights instead of read again (``weight_cache.load``). A load that initialised tensors the files do not hold
    is not kept (and evicts nothing). A LoRA adapter folder: its base loaded so, the adapter merged in memory
    (``lora.load_merged``); kept merged where the adapter replaces modules (``_merged_cache_key``)."""
    from batchrl.training.models import lora
    from batchrl.training.models import weight_cache
    from batchrl.training.models.weights import load_weights_in_place

    dtype = resolve_dtype(dtype)
    build = lambda entry: _empty_model(entry, auto_class, dtype, device)  # noqa: E731
    if lora.is_adapter_folder(path):  # a reward model's adapter (its head included) is kept merged: merging is slow at 7B
        model, _ = weight_cache.load(
            _merged_cache_key(path, dtype, device, kind), build=build, extras=_model_extras,
            load=lambda: lora.load_merged(path, lambda base: load_pretrained(base, auto_class, dtype=dtype,
                                                                             device=device, kind=kind, **load_kwargs)),
            copy_state=lambda empty, tensors: load_weights_in_place(empty, path, tensors=tensors),
            keep_if=lambda loaded: _merged_covered(loaded, path))
        return model
    cache_key = _weight_cache_key(path, dtype, device, kind)

    def from_files():
        return auto_class.from_pretrained(path, dtype=dtype, **load_kwargs, **placed_on(device)).to(device).eval()

    model, _ = weight_cache.load(
        cache_key, load=from_files, build=build,
        copy_state=lambda empty, tensors: load_weights_in_place(empty, path, tensors=tensors), extras=_model_extras,
        keep_if=lambda loaded: not _uncovered(loaded, path))
    return model


def load_checkpoint_in_place(model: Any, path: str, *, dtype: torch.dtype | str, device: str,
                             tensors: dict[str, torch.Tensor] | None = None) -> bool:
    """Copy the weights of ``path`` (another checkpoint of ``model``'s model) into ``model``: from the job worker's
    weight cache where it holds them (device to device), else from ``tensors`` (``weights.read_weights``) or the
    files, then kept in the cache for the next load. False, ``model`` untouched, when they do not fit it. A LoRA
    adapter folder: its base's weights copied so, then the adapter merged into them in place (``tensors``: the
    base's, as ``read_weights`` reads an adapter folder)."""
    from batchrl.training.models import lora
    from batchrl.training.models import resident_weights
    from batchrl.training.models import weight_cache
    from batchrl.training.models.weights import load_weights_in_place

    if lora.is_adapter_folder(path):
        if not lora.merges_in_place(path) or not load_checkpoint_in_place(
                model, lora.resolve_base(path), dtype=dtype, device=device, tensors=tensors):
            return False
        lora.merge_in_place(model, path)
        return True
    copy = lambda m, cached: load_weights_in_place(m, path, tensors=cached)  # noqa: E731
    if weight_cache.load_into(resident_weights.key_of(path), model, copy):  # a trainer's weights, still on the device
        return True
    cache_key = _weight_cache_key(path, resolve_dtype(dtype), device)
    if weight_cache.load_into(cache_key, model, copy):
        return True
    if not load_weights_in_place(model, path, tensors):
        return False
    extras = _model_extras(model)
    extras["config"]._name_or_path = path  # a model built from the entry later: as if loaded from ``path``
    weight_cache.keep(cache_key, model, extras)
    return True


def _model_extras(model: Any) -> dict[str, Any]:
    """What the weight cache keeps beside a model's weights to build it again: its config objects."""
    kept = {"config": copy.deepcopy(model.config)}
    if getattr(model, "generation_config", None) is not None:
        kept["generation_config"] = copy.deepcopy(model.generation_config)
    return kept


def cached_in_worker(path: str, *, dtype: torch.dtype | str, device: str) -> bool:
    """Whether the job worker's weight cache holds ``path``'s weights (no need to read them ahead; an adapter: its
    base's)."""
    from batchrl.training.models import weight_cache
    from batchrl.training.models.lora import resolve_base

    cache_key = _weight_cache_key(resolve_base(path), resolve_dtype(dtype), device)
    return cache_key is not None and weight_cache.get(cache_key) is not None


def load_model_and_tokenizer(path: str, *, dtype: torch.dtype | str = torch.float32, device: str = "cpu"):
    """Load any HF causal-LM folder (the tiny default or a real model) in eval mode on ``device`` (from the job
    worker's weight cache where it holds the folder: ``load_pretrained``)."""
    from transformers import AutoModelForCausalLM

    with phase("load_model"):
        tokenizer = load_tokenizer(path)
        model = load_pretrained(path, AutoModelForCausalLM, dtype=dtype, device=device, kind="causal_lm")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
