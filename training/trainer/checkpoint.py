"""Atomic, resumable checkpoints on top of DeepSpeed's ``save_checkpoint``/``load_checkpoint``.

Layout under ``ckpt_dir``::

    step_00000012/        one DeepSpeed tag: model + optimizer + scheduler (+ ZeRO shards)
        rng_rank0.pt      python / numpy / torch (/ cuda) RNG states of that rank
        trainer_state.json data position (epoch, step_in_epoch, global_step) + metrics history
    latest                name of the newest complete tag, written last (atomic replace)
    completed.json        a run that reached its end: its run key and result (no engine state: the HF
                          export is the output)

A checkpoint is written to ``.tmp-<tag>`` and renamed into place, then ``latest`` is replaced, so a
process killed at any moment leaves either the previous or the new checkpoint, never a half one.
Only the newest ``keep_last`` tags are kept. ``export_hf_model`` writes the final weights as an HF
folder (safetensors + config + tokenizer), also through a temp dir + rename.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
from typing import Any

import numpy as np
import torch

from batchrl.common import fsutil
from batchrl.training.trainer.safetensors_writer import parallel_shard_writes

_LOCAL_FS = fsutil.filesystem_for("/")[0]

LATEST = "latest"
# HF exports are written in shards, each by its own thread hashing as it writes (``parallel_shard_writes``): one
# file is hashed on one core while the GPU idles. The shard size is an eighth of the weights, between these bounds
# (a 512 MB cap alone left SmolLM2-135M in one shard, one thread doing nearly all of it: bench/RESULTS.md); a model
# under 64 MB stays one file.
EXPORT_SHARDS, EXPORT_SHARD_MIN, EXPORT_SHARD_MAX = 8, 64 * 10**6, 512 * 10**6


def export_shard_size(tensors: Any) -> int:
    """``save_pretrained``'s ``max_shard_size`` (bytes) for the weights ``tensors`` (an iterable): their bytes over
    ``EXPORT_SHARDS``, within ``EXPORT_SHARD_MIN``..``EXPORT_SHARD_MAX``, in whole kB (a size fixed by the model:
    the same export layout, the same content hash, every time)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    per_shard = -(-total // EXPORT_SHARDS // 1000) * 1000
    return int(min(EXPORT_SHARD_MAX, max(EXPORT_SHARD_MIN, per_shard)))
TAG_PREFIX = "step_"


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _write_text_atomic(path: str, text: str) -> None:
    fsutil.atomic_write_bytes(_LOCAL_FS, path, text.encode())


COMPLETED = "completed.json"


def write_completion(ckpt_dir: str, run_key: str, result: dict[str, Any]) -> None:
    """Record (rank 0, atomically) that the run ``run_key`` finished with ``result``; every rank waits."""
    if _rank() == 0:
        _write_text_atomic(os.path.join(ckpt_dir, COMPLETED),
                           json.dumps({"run_key": run_key, "result": result}, sort_keys=True, default=str))
    _barrier()


def read_completion(ckpt_dir: str) -> dict[str, Any]:
    """``{"run_key", "result"}`` of the run that finished here, or {} (none, or a damaged record)."""
    try:
        with open(os.path.join(ckpt_dir, COMPLETED)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """Complete checkpoint tags, oldest first (temp dirs of interrupted saves are ignored)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(d for d in os.listdir(ckpt_dir)
                  if d.startswith(TAG_PREFIX) and os.path.isdir(os.path.join(ckpt_dir, d)))


def latest_tag(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(path):
        return None
    tag = open(path).read().strip()
    return tag if os.path.isdir(os.path.join(ckpt_dir, tag)) else None


def save_checkpoint(engine: Any, ckpt_dir: str, step: int, trainer_state: dict[str, Any],
                    *, keep_last: int = 2, trainable_only: bool = False) -> str:
    """Save engine + RNG + ``trainer_state`` as tag ``step_<step>``; returns the checkpoint path.
    ``trainable_only`` (LoRA): the frozen base's weights are left out (it is its own artifact).

    Every rank writes its shards into the shared temp dir; rank 0 renames, updates ``latest`` and
    prunes old tags after a barrier.
    """
    tag = tag_for(step)
    tmp_root = os.path.join(ckpt_dir, f".tmp-{tag}")
    if _rank() == 0:
        shutil.rmtree(tmp_root, ignore_errors=True)
        os.makedirs(tmp_root, exist_ok=True)
    _barrier()
    engine.save_checkpoint(tmp_root, tag=tag, save_latest=False,
                           client_state={"global_step": step}, exclude_frozen_parameters=trainable_only)
    tmp_tag = os.path.join(tmp_root, tag)
    torch.save(rng_state(), os.path.join(tmp_tag, f"rng_rank{_rank()}.pt"))
    _barrier()
    final = os.path.join(ckpt_dir, tag)
    if _rank() == 0:
        _write_text_atomic(os.path.join(tmp_tag, "trainer_state.json"),
                           json.dumps({**trainer_state, "global_step": step}, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step replaces it whole
        os.replace(tmp_tag, final)
        shutil.rmtree(tmp_root, ignore_errors=True)
        _write_text_atomic(os.path.join(ckpt_dir, LATEST), tag)
        for old in list_checkpoints(ckpt_dir)[:-keep_last]:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    _barrier()
    return final


def saved_world_size(ckpt_dir: str) -> int | None:
    """Number of ranks that wrote the ``latest`` checkpoint (None: no checkpoint, or not recorded)."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        return None
    with open(os.path.join(ckpt_dir, tag, "trainer_state.json")) as f:
        return json.load(f).get("world_size")


def needs_universal(ckpt_dir: str, zero_stage: int) -> bool:
    """Resuming a ZeRO 1-3 checkpoint on another number of ranks: its optimiser state is partitioned per
    rank, so it is loaded through DeepSpeed's universal checkpoint (the engine must be built for that)."""
    saved = saved_world_size(ckpt_dir)
    return zero_stage > 0 and saved is not None and saved != int(os.environ.get("WORLD_SIZE", "1"))


def universal_checkpoint(ckpt_dir: str, tag: str) -> str:
    """``<tag>/universal``: DeepSpeed's universal form of a ZeRO checkpoint (weights and optimiser state
    per parameter, whole), converted once by rank 0 (temp dir + rename), loadable by any number of ranks."""
    out = os.path.join(ckpt_dir, tag, "universal")
    if _rank() == 0 and not os.path.isdir(out):
        from deepspeed.checkpoint import ds_to_universal

        tmp = f"{out}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        args = argparse.Namespace(input_folder=os.path.join(ckpt_dir, tag), output_folder=os.path.join(tmp, tag),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)  # a plain engine's client state lacks Megatron's info
        with contextlib.redirect_stdout(sys.stderr):  # the job's stdout carries its Pipes messages
            ds_to_universal.main(args)
        os.replace(tmp, out)
    _barrier()
    return out


def load_checkpoint(engine: Any, ckpt_dir: str, zero_stage: int = 0,
                    trainable_only: bool = False) -> dict[str, Any] | None:
    """Restore engine (model, optimizer, scheduler) and RNG from ``latest``; return trainer_state.

    Returns None when there is no complete checkpoint (fresh start). A run may resume on another number
    of ranks: without ZeRO the optimiser state is whole in every checkpoint; ZeRO 1-3 partition it per
    rank, so such a checkpoint is converted to DeepSpeed's universal form first (``needs_universal``:
    the engine was built with ``load_universal``). ``trainable_only``: saved without the frozen weights.
    """
    tag = latest_tag(ckpt_dir)
    if tag is None:
        return None
    source = ckpt_dir
    if needs_universal(ckpt_dir, zero_stage):
        if not engine.load_universal_checkpoint():
            raise ValueError(f"{ckpt_dir}/{tag} was saved by {saved_world_size(ckpt_dir)} ranks with ZeRO stage "
                             f"{zero_stage}: build the engine with universal=True to resume it on another count")
        source = universal_checkpoint(ckpt_dir, tag)
    path, _client = engine.load_checkpoint(source, tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=True, load_module_strict=not trainable_only)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir}/{tag}")
    with open(os.path.join(ckpt_dir, tag, "trainer_state.json")) as f:
        state = json.load(f)
    rng_path = os.path.join(ckpt_dir, tag, f"rng_rank{_rank()}.pt")
    if not os.path.exists(rng_path):  # resumed on more ranks than saved it: continue rank 0's stream
        rng_path = os.path.join(ckpt_dir, tag, "rng_rank0.pt")
    set_rng_state(torch.load(rng_path, weights_only=False))
    return state


def _full_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """Full (unsharded) weights; under ZeRO-3 they are gathered from every rank."""
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return None  # save_pretrained reads the module's own state dict


def _write_tokenizer(tokenizer: Any, folder: str) -> None:
    """The tokenizer's own files, copied byte for byte from the folder it was loaded from (training does not
    change it; batchrl's loader only fills a missing pad token with eos, as it does again at every load);
    ``save_pretrained`` where there is none. Saving it again would rewrite them (transformers spells
    out the class's pipeline: another class name, the pre-tokenizer's regex, a normaliser), so a checkpoint's
    tokenizer key would differ from its base's although both tokenise alike — and evaluation, which shares one
    engine between checkpoints of one model and tokenizer, would load the model again."""
    from batchrl.training.models.folders import tokenizer_files

    source = getattr(tokenizer, "name_or_path", "") or ""
    names = tokenizer_files(source) if os.path.isdir(source) else []
    if not any(name.startswith("tokenizer") or name.endswith((".model", ".txt")) for name in names):
        tokenizer.save_pretrained(folder)
        return
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))


TRAIN_RECORD = "batchrl_train.json"  # next to an export: the run's config and metrics (times included)


def write_train_record(out_dir: str, record: dict[str, Any]) -> None:
    """``TRAIN_RECORD`` beside the export ``out_dir`` (rank 0): the run's config and metrics, times included."""
    if _rank() == 0:
        _write_text_atomic(os.path.join(os.path.dirname(os.path.abspath(out_dir)), TRAIN_RECORD),
                           json.dumps(record, indent=2, sort_keys=True, default=str))


def export_hf_model(engine_or_model: Any, tokenizer: Any, out_dir: str,
                    extra_metadata: dict[str, Any] | None = None) -> str:
    """Write an HF folder (``model.safetensors`` or its shards, ``config.json``, tokenizer files) atomically.

    Loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)`` and vLLM. ``extra_metadata`` goes to
    ``TRAIN_RECORD`` beside the folder, not into it: the folder is exactly the weights' content (the job's
    content hash of it is the published data version, and wall-clock times never change it).
    """
    module = getattr(engine_or_model, "module", engine_or_model)
    state_dict = _full_state_dict(engine_or_model) if hasattr(engine_or_model, "module") else None
    if _rank() == 0:
        tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with parallel_shard_writes():  # shards written side by side and hashed as written
            module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True,
                                   max_shard_size=export_shard_size(
                                       (state_dict or module.state_dict()).values()))
        if tokenizer is not None:
            _write_tokenizer(tokenizer, tmp)
        if extra_metadata:
            write_train_record(out_dir, extra_metadata)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir
