"""LoRA adapters (``peft``): trained by every trainer when ``lora_rank > 0``, published as adapter-only artifacts,
and loaded by every consumer as base + adapter.

An adapter folder holds exactly two files: ``adapter_model.safetensors`` (the low-rank matrices and any
``modules_to_save``, e.g. a reward model's score head) and ``adapter_config.json`` (PEFT's own format, keys
sorted). Its content hash is the artifact's data version; it never holds the base's weights.

Its base is named by ``base_model_name_or_path`` in ``adapter_config.json``. For a base that is a published
artifact (``<root>/<asset>/<data version>/``, recognised by its ``lineage.json``) that is ``<asset>/<data
version>``, resolved against the adapter's own storage root (``adapter_base``): the same adapter has the same
bytes, hence the same data version, under any root, and an ``s3://`` root's local cache has the same layout.
Any other base (a plain folder) is named by its absolute path, as PEFT itself does.

Consumers call the usual loaders (``tiny_model.load_pretrained``, ``load_model_and_tokenizer``,
``load_tokenizer``, ``reward_model.load_reward_model``, ``value_model.load_value_model``): each has one branch to
``load_merged`` here, which loads the base (from the job worker's weight cache where it holds it), applies the
adapter and merges it in memory. Nothing merged is written to storage; ``batchrl export`` does that on request.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"
# PEFT task types of batchrl's models: policy / DPO (causal LM), reward model (sequence classifier), critic
# (token classifier). PEFT keeps the classifiers' new head (``score``) trainable and saves it with the adapter.
CAUSAL_LM, SEQ_CLS, TOKEN_CLS = "CAUSAL_LM", "SEQ_CLS", "TOKEN_CLS"
CLASSIFIER_HEAD = "score"  # the head transformers' *ForSequenceClassification / *ForTokenClassification LMs add
# the list fields PEFT writes in whatever order a set iterates: sorted, so an adapter's bytes are stable
_SET_VALUED = ("target_modules", "modules_to_save", "exclude_modules")


def enabled(cfg: Any) -> bool:
    """Whether a trainer config asks for LoRA (``lora_rank > 0``) rather than full fine-tuning."""
    return int(getattr(cfg, "lora_rank", 0) or 0) > 0


def is_adapter_folder(path: str | None) -> bool:
    """A folder holding a PEFT adapter and no full model of its own (no ``config.json``)."""
    return bool(path) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and \
        not os.path.isfile(os.path.join(path, "config.json"))


def read_adapter_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        return json.load(f)


def base_reference(base_path: str) -> str:
    """How an adapter names the base at ``base_path``: ``<asset>/<data version>`` for a published artifact
    (root-independent), else the absolute path."""
    base_path = os.path.abspath(base_path)
    if os.path.isfile(os.path.join(base_path, "lineage.json")):
        return f"{os.path.basename(os.path.dirname(base_path))}/{os.path.basename(base_path)}"
    return base_path


def adapter_base(path: str) -> str:
    """The base model folder of the adapter at ``path``: its absolute ``base_model_name_or_path``, or that
    reference resolved against the adapter's storage root (``<root>/<asset>/<version>``: two levels up), or
    against the working directory; a name that is no folder (a hub id) is returned as it is."""
    reference = read_adapter_config(path).get("base_model_name_or_path") or ""
    if not reference:
        raise ValueError(f"{path}: adapter_config.json names no base model (base_model_name_or_path)")
    if os.path.isabs(reference):
        return reference
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    in_root = os.path.join(root, reference)
    return in_root if os.path.isdir(in_root) else reference


def resolve_base(path: str) -> str:
    """``path`` itself, or for an adapter folder its base (through any chain of adapters)."""
    seen = set()
    while is_adapter_folder(path):
        if path in seen:
            raise ValueError(f"{path}: adapter base references form a cycle")
        seen.add(path)
        path = adapter_base(path)
    return path


def peft_config(cfg: Any, task_type: str):
    """A ``peft.LoraConfig`` from a trainer config's ``lora_*`` fields."""
    from peft import LoraConfig

    targets, to_save, excluded = list(cfg.lora_target_modules), list(cfg.lora_modules_to_save), None
    if task_type in (SEQ_CLS, TOKEN_CLS):  # the new head: trained in full, never adapted (all-linear would)
        to_save, excluded = sorted({*to_save, CLASSIFIER_HEAD}), [CLASSIFIER_HEAD]
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, exclude_modules=excluded,
                      modules_to_save=to_save or None, task_type=task_type, bias="none")


def check_same_shape(cfg: Any, adapter_path: str) -> None:
    """A run that continues an adapter (the policy chain) trains it as it is: rank and alpha must agree."""
    saved = read_adapter_config(adapter_path)
    if (saved.get("r"), saved.get("lora_alpha")) != (cfg.lora_rank, cfg.lora_alpha):
        raise ValueError(f"{adapter_path}: this adapter has rank {saved.get('r')} and alpha {saved.get('lora_alpha')}, "
                         f"the config asks for lora_rank {cfg.lora_rank} and lora_alpha {cfg.lora_alpha}: continue "
                         "it with the same values, or start a new chain from the base model")


def trainable(load_model: Callable[..., tuple[Any, Any]], model_path: str, cfg: Any, task_type: str,
              placement: dict[str, Any]) -> tuple[Any, Any, str]:
    """``(peft model, tokenizer, base folder)`` to train: ``load_model(base, **placement)`` (the trainer's
    ``engine.frozen_base_placement``) with a new adapter of ``cfg``'s shape, or, when ``model_path`` is itself an
    adapter (a policy chain's parent), with that adapter loaded trainable (it is trained further, the base stays
    frozen)."""
    from peft import PeftModel, get_peft_model

    if is_adapter_folder(model_path):
        check_same_shape(cfg, model_path)
        base = resolve_base(model_path)
        model, tokenizer = load_model(base, **placement)
        model = PeftModel.from_pretrained(model, model_path, is_trainable=True)
    else:
        base = model_path
        model, tokenizer = load_model(model_path, **placement)
        model = get_peft_model(model, peft_config(cfg, task_type))
    with torch.no_grad():  # what is trained is fp32 (a head copied from a bf16 base too): the optimiser's precision
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    return model, tokenizer, base


def is_peft_model(model: Any) -> bool:
    return hasattr(getattr(model, "module", model), "peft_config")


def _sorted_config(config: Any, base_ref: str) -> dict[str, Any]:
    data = config.to_dict()
    data["base_model_name_or_path"] = base_ref
    data["inference_mode"] = True
    for key in _SET_VALUED:
        if isinstance(data.get(key), (list, set, tuple)):
            data[key] = sorted(data[key])
    return data


def write_adapter_folder(folder: str, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` into ``folder`` (which exists)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in sorted(weights.items())},
              os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def adapter_weights(engine_or_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors (PEFT's saved names) of a PEFT model or a DeepSpeed engine around one; under
    ZeRO-3 gathered from every rank (all ranks must call this)."""
    from peft import get_peft_model_state_dict

    module = getattr(engine_or_model, "module", engine_or_model)
    full = None
    if hasattr(engine_or_model, "module") and getattr(engine_or_model, "zero_optimization_stage", lambda: 0)() == 3:
        full = engine_or_model._zero3_consolidated_16bit_state_dict()
    return get_peft_model_state_dict(module, state_dict=full)


def save_adapter(engine_or_model: Any, out_dir: str, base_path: str) -> str:
    """Write the adapter of a PEFT model (or a DeepSpeed engine around one) to ``out_dir`` atomically (temp dir,
    rename): the adapter's two files only, its base named by ``base_reference(base_path)``. Rank 0 writes."""
    weights = adapter_weights(engine_or_model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        module = getattr(engine_or_model, "module", engine_or_model)
        config = _sorted_config(module.peft_config[getattr(module, "active_adapter", "default")],
                                base_reference(base_path))
        tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write_adapter_folder(tmp, weights, config)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out_dir


@torch.no_grad()
def apply_merged(model: Any, adapter_path: str) -> Any:
    """``model`` (the adapter's base, loaded) with the adapter applied and merged into its weights, in memory:
    a plain transformers model again (``W + (alpha / r) B A``; ``modules_to_save`` replace their modules)."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, adapter_path).merge_and_unload()
    return merged.requires_grad_(True).eval()  # peft froze the base: as a plain load leaves it (trainable in full)


def merges_in_place(adapter_path: str) -> bool:
    """Whether ``merge_in_place`` can take this adapter: plain LoRA weights, no modules it replaces."""
    config = read_adapter_config(adapter_path)
    return not config.get("modules_to_save") and not config.get("use_dora")


@torch.no_grad()
def merge_in_place(model: Any, adapter_path: str) -> None:
    """Merge the adapter into ``model`` (its base's weights, loaded) in place: every adapted weight's own storage
    gets ``+ (alpha / r) B A`` (an engine's captured CUDA graphs stay valid) and the adapter's wrappers are
    removed again. An adapter with ``modules_to_save`` (a classifier head) replaces modules: use ``apply_merged``."""
    from peft import PeftModel

    if not merges_in_place(adapter_path):
        raise ValueError(f"{adapter_path}: this adapter replaces modules (modules_to_save, DoRA); use apply_merged")
    was_training = model.training
    merged = PeftModel.from_pretrained(model, adapter_path).merge_and_unload(safe_merge=False)
    if merged is not model:
        raise RuntimeError("peft returned another model object from merge_and_unload")
    model.requires_grad_(True).train(was_training)


def load_merged(path: str, load_base: Callable[[str], Any]) -> Any:
    """The model of the adapter folder ``path``: ``load_base(base folder)`` with the adapter merged in (a
    chain of adapters is applied base first). The torch RNG is left as it was (a classifier head the base
    lacks is initialised at random before the adapter's own replaces it)."""
    base = adapter_base(path)
    with torch.random.fork_rng(devices=[]):
        model = load_merged(base, load_base) if is_adapter_folder(base) else load_base(base)
        return apply_merged(model, path)


def adapter_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
