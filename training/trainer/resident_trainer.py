"""The policy's trainer stays resident in the job worker from one policy update to the next (issue 32).

Each RL iteration's ``policy_checkpoint`` job trained the checkpoint the previous one had just exported: it built
its model again (from the weight cache or the files), wrapped it in PEFT where it is LoRA and in a new DeepSpeed
engine — ~0.3 s of set-up plus ~1 s of the job's wall outside its steps at SmolLM2-135M on the H200, 1.37 s at the
Qwen2.5-7B shape with LoRA (``bench/RESULTS.md``). The worker keeps the last policy job's engine instead; the next
policy job whose model is the artifact that engine's weights were published as (its data version, settled by the
job's runtime as ``training/models/resident_weights.py`` does for the weights it offers) and whose settings build the same engine
takes it over with a new optimiser and schedule — what a fresh job starts from, as batchrl's update always starts
each iteration with a fresh AdamW — and trains it in place.

Same results as a fresh job: the export is the fp32 (or adapter) weights exactly, so the kept module holds what a
load of the published artifact gives; the job's seed is set again; DeepSpeed's counters start from zero. Kept only
where that holds and is cheap: the worker (its weight cache on), one rank, ZeRO-0 (not fp16), no critic, a run that
reached its end, and weights within ``limit_bytes``. Under DeepSpeed's own bf16 optimiser (``precision: bf16``, e.g.
a LoRA run at the 7B shape) the engine holds an fp32 master copy of what is trained: that engine is retired when kept
(its hooks removed, its master copy freed) and the next job builds a new engine around the kept module, whose master
copy is made from the bf16 weights exactly as a fresh job's is from the published ones (the export is those bf16
weights). Another trainer job releases it first (its memory is theirs), as does
any job failure while it is claimed (the claim took it out). The weights the trainer offered to the rollout engine
alias the kept module: the claim drops that weight-cache entry before training changes them.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from batchrl.common.environment_variables import read
from batchrl.training.models import resident_weights

from batchrl.training.models import weight_cache

ENV = "BATCHRL_RESIDENT_TRAINER_GB"
# "1": a new engine around the kept module even where the kept engine could be renewed (what a bf16 engine always
# gets); the CPU tests' way through that path, as DeepSpeed's bf16 optimiser is GPU-only here
REBUILD_ENV = "BATCHRL_RESIDENT_TRAINER_REBUILD"
DEVICE_FRACTION = 0.10
# settings that build the engine and the model around it; the rest (lr, schedule, seed, ...) a new optimiser takes
ENGINE_FIELDS = ("zero_stage", "precision", "micro_batch_size", "grad_accum", "max_grad_norm",
                 "gradient_checkpointing", "torch_compile", "lora_rank", "lora_alpha", "lora_dropout",
                 "lora_target_modules", "lora_modules_to_save")


@dataclass
class Kept:
    settings: dict
    engine: Any
    tokenizer: Any
    lora_base: str | None
    export: str  # real path of the folder the job exported (what the runtime hashes)
    data_version: str | None = None  # set once the runtime has hashed it: the artifact a next job names
    retired: bool = False  # the engine was taken apart: the next job builds a new one around ``engine.module``


_lock = threading.Lock()
_kept: Kept | None = None


def settings_of(cfg: Any) -> dict:
    data = cfg.model_dump()
    return {k: data.get(k) for k in ENGINE_FIELDS}


def limit_bytes() -> int:
    """``BATCHRL_RESIDENT_TRAINER_GB``, else a tenth of the GPU's memory, else the weight cache's limit
    (``weight_cache.resident_limit_bytes``)."""
    return weight_cache.resident_limit_bytes(ENV, DEVICE_FRACTION)


def release() -> None:
    """Drop the kept trainer (another trainer job needs the memory, or it cannot be used)."""
    global _kept
    with _lock:
        _kept = None


def claim(cfg: Any, model_path: str, ckpt_dir: str) -> Kept | None:
    """The kept trainer when ``model_path`` is the artifact its weights were published as and ``cfg`` builds the
    same engine, taken out of the worker (a failing job does not put it back); else None, and whatever was kept
    is released. A job resuming from its own checkpoints never claims."""
    global _kept
    with _lock:
        kept, _kept = _kept, None
    if kept is None or kept.data_version is None or not weight_cache.enabled():
        return None
    if os.listdir(ckpt_dir) or kept.settings != settings_of(cfg) or \
            resident_weights.data_version_of(model_path) != kept.data_version:
        return None
    weight_cache.forget(resident_weights.artifact_key(kept.data_version))  # it aliases the module about to be trained
    return kept


def renew(kept: Kept, cfg: Any, total_steps: int) -> Any:
    """Give the claimed engine a new optimiser and schedule, as ``deepspeed.initialize`` did for a fresh job, and
    DeepSpeed's counters from zero; the module back in training mode (a retired engine: a new engine around its
    module, as ``deepspeed.initialize`` builds it for a fresh job). Returns the engine."""
    from batchrl.training.trainer.engine import init_deepspeed, make_optimizer, make_scheduler

    if kept.retired:
        module = kept.engine.module
        module.config.use_cache = False
        module.train()
        optimizer = make_optimizer(module, cfg)
        return init_deepspeed(module, cfg, optimizer, make_scheduler(optimizer, cfg, total_steps))
    engine = kept.engine
    engine.zero_grad()
    optimizer = make_optimizer(engine.module, cfg)
    scheduler = make_scheduler(optimizer, cfg, total_steps)
    engine.client_optimizer = engine.basic_optimizer = engine.optimizer = optimizer
    engine.client_lr_scheduler = engine.lr_scheduler = scheduler
    engine.global_steps = engine.global_samples = engine.micro_steps = engine.skipped_steps = 0
    engine.module.config.use_cache = False
    engine.module.train()
    return engine


def keep(loop: Any, cfg: Any, result: dict) -> bool:
    """After a policy job that reached its end: keep its engine for the next policy job when it is safe and within
    ``limit_bytes`` (optimiser state and gradients freed). Returns whether it was kept."""
    global _kept
    engine = loop.engine
    ok = (weight_cache.enabled() and not result.get("stopped_early") and not getattr(cfg, "critic", False)
          and cfg.zero_stage == 0 and not engine.fp16_enabled()
          and int(os.environ.get("WORLD_SIZE", "1")) == 1 and os.path.isdir(result.get("model_dir") or ""))
    size = sum(p.nbytes for p in engine.module.parameters()) if ok else 0
    if not ok or size > limit_bytes():
        release()
        return False
    engine.zero_grad()
    retired = engine.bfloat16_enabled() or read(REBUILD_ENV)
    if retired:
        _retire(engine)
    else:
        engine.optimizer.state.clear()  # a next job starts a new AdamW: the moments would only hold memory
    with _lock:
        _kept = Kept(settings_of(cfg), engine, loop.tokenizer, loop.lora_base, os.path.realpath(result["model_dir"]),
                     retired=retired)
    return True


def _retire(engine: Any) -> None:
    """Take the engine apart, its module kept: the optimiser's hooks on the parameters (and its fp32 master copy
    with them) and the engine's forward hooks on the module go, so a next engine around the module is the only one
    that acts on it."""
    engine.destroy()  # the bf16 optimiser's gradient-accumulation hooks and its parameters' hp mappings
    for name in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        handle = getattr(engine, name, None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
            setattr(engine, name, None)
    engine.optimizer = engine.basic_optimizer = engine.client_optimizer = None
    engine.lr_scheduler = engine.client_lr_scheduler = None
    engine.module.zero_grad(set_to_none=True)


def settle(output: str | None, content_hash: str | None) -> bool:
    """The job's output folder was hashed: the kept trainer (if it exported that folder) now stands for the
    artifact of that content; a kept trainer whose export was not this job's output is released."""
    global _kept
    with _lock:
        if _kept is None:
            return False
        if output and content_hash and _kept.export == os.path.realpath(output) and _kept.data_version is None:
            _kept.data_version = content_hash[:16]
            return True
        if _kept.data_version is None:
            _kept = None
        return False
