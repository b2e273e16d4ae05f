"""Atomic, resumable checkpoints on top of DeepSpeed's ``save_checkpoint``/``load_checkpoint``.

Layout under ``ckpt_dir``::

    step_00000012/        one DeepSpeed tag: model + optimizer + scheduler (+ ZeRO shards)
        rng_rank0.pt      python / numpy / torch (/ cuda) RNG states of that rank
        trainer_state.json data position (epoch, step_in_epoch, global_step) + metrics history
    latest                name of the newest complete tag, written last (atomic replace)

A checkpoint is written to ``.tmp-<tag>`` and renamed into place, then ``latest`` is replaced, so a
process killed at any moment leaves either the previous or the new checkpoint, never a half one.
Only the newest ``keep_last`` tags are kept. ``export_hf_model`` writes the final weights as an HF
folder (safetensors + config + tokenizer), also through a temp dir + rename.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch

from batchrl import fsutil

_LOCAL_FS = fsutil.filesystem_for("/")[0]

LATEST = "latest"
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
                    *, keep_last: int = 2) -> str:
    """Save engine + RNG + ``trainer_state`` as tag ``step_<step>``; returns the checkpoint path.

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
                           client_state={"global_step": step})
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


def load_checkpoint(engine: Any, ckpt_dir: str, zero_stage: int = 0) -> dict[str, Any] | None:
    """Restore engine (model, optimizer, scheduler) and RNG from ``latest``; return trainer_state.

    Returns None when there is no complete checkpoint (fresh start). Without ZeRO a run may resume on
    another number of ranks (the optimiser state is whole in every checkpoint); ZeRO 1-3 partition it
    per rank, so that is refused with the way out named.
    """
    tag = latest_tag(ckpt_dir)
    if tag is None:
        return None
    with open(os.path.join(ckpt_dir, tag, "trainer_state.json")) as f:
        saved_world = json.load(f).get("world_size")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if zero_stage > 0 and saved_world not in (None, ranks):
        raise ValueError(f"{ckpt_dir}/{tag} was saved by {saved_world} ranks with ZeRO stage {zero_stage}, whose "
                         f"optimiser state is partitioned per rank: resume it on {saved_world} ranks, or train "
                         "with zero_stage=0 to resume on any number")
    path, _client = engine.load_checkpoint(ckpt_dir, tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
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


def export_hf_model(engine_or_model: Any, tokenizer: Any, out_dir: str,
                    extra_metadata: dict[str, Any] | None = None) -> str:
    """Write an HF folder (``model.safetensors``, ``config.json``, tokenizer files) atomically.

    Loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)`` and vLLM.
    """
    module = getattr(engine_or_model, "module", engine_or_model)
    state_dict = _full_state_dict(engine_or_model) if hasattr(engine_or_model, "module") else None
    if _rank() == 0:
        tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra_metadata:
            _write_text_atomic(os.path.join(tmp, "batchrl_train.json"),
                               json.dumps(extra_metadata, indent=2, sort_keys=True, default=str))
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir
