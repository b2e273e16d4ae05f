"""DeepSpeed engine construction for the trainer jobs (CPU/gloo in tests, GPU under a launcher).

DeepSpeed is imported inside ``init_deepspeed`` only, so importing the trainer package stays cheap
and the library remains usable without it.
"""
from __future__ import annotations

import math
import os
import socket
from typing import Any

import torch

from batchrl.common.environment_variables import read

_ENV_OWNER = "BATCHRL_DIST_ENV_PID"  # marks rendezvous variables we set ourselves


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """Set the rendezvous variables DeepSpeed needs when not started by deepspeed/torchrun.

    Under a launcher these are already set and left untouched. Values this function set in a
    parent process (inherited by a job it started) are replaced: the parent's port is taken.
    """
    owner_pid, _, owner_port = (read(_ENV_OWNER) or "").partition(":")
    inherited = owner_pid and owner_pid != str(os.getpid()) and os.environ.get("MASTER_PORT") == owner_port
    if inherited:  # a launcher (torchrun) would have set a new port: these are the parent's
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    if "RANK" in os.environ and "MASTER_PORT" in os.environ:
        return
    port = str(_free_port())
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    os.environ[_ENV_OWNER] = f"{os.getpid()}:{port}"


def use_cuda() -> bool:
    return torch.cuda.is_available()


def gpu_precision(cfg: Any) -> str:
    """The precision a GPU job runs in: ``bf16_amp`` becomes ``bf16`` at ZeRO-3, where forward passes must
    go through DeepSpeed's engine (it gathers the partitioned and tied weights) and the engine turns a
    surrounding autocast off (``bf16_amp`` would compute in fp32 there)."""
    return "bf16" if cfg.precision == "bf16_amp" and cfg.zero_stage == 3 else cfg.precision


def frozen_base_placement(cfg: Any) -> dict[str, Any]:
    """How a LoRA run loads its frozen base (``lora.trainable``): on a GPU in bf16 straight onto its device when
    the run computes in bf16 (``bf16`` or ``bf16_amp``: a frozen fp32 copy would only double the memory and the
    load; the adapters stay fp32, PEFT's default, and the job worker's weight cache can serve the base the rollouts
    and reference pass loaded); else as full fine-tuning loads it (fp32 on the host; the CPU stays fp32)."""
    if use_cuda() and gpu_precision(cfg) in ("bf16", "bf16_amp"):
        return {"dtype": torch.bfloat16, "device": f"cuda:{os.environ.get('LOCAL_RANK', '0')}"}
    return {}


def trainer_clips(cfg: Any) -> bool:
    """ZeRO-0 with fp32 weights: the trainer clips the gradients itself (torch's foreach kernels, a few
    launches) instead of DeepSpeed's loop of one norm and one scale per parameter."""
    return cfg.zero_stage == 0 and not (use_cuda() and gpu_precision(cfg) == "bf16")


def deepspeed_config(cfg: Any, universal: bool = False) -> dict:
    """DeepSpeed config dict from a trainer config (zero stage, precision, accumulation, clipping).

    ``train_batch_size = micro_batch_size * grad_accum * world_size``; bf16 is enabled only on GPU
    (CPU keeps fp32 so results are exact and reproducible). ``universal``: the engine will load a
    universal checkpoint (a ZeRO run resumed on another number of ranks).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    bf16 = use_cuda() and gpu_precision(cfg) == "bf16"
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world,
        "gradient_clipping": 0.0 if trainer_clips(cfg) else cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage,
                              # full weights for the HF export are gathered on save under ZeRO-3
                              "stage3_gather_16bit_weights_on_model_save": cfg.zero_stage == 3},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # a client torch optimizer is passed: no FusedAdam/cpu_adam compile
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": universal},
    }


def make_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """Torch AdamW: the fused kernel on GPUs (one launch for all parameters), the per-parameter loop on
    CPU (bitwise-stable resume) unless ``cfg.fused_optimizer`` says otherwise."""
    fused = cfg.fused_optimizer if getattr(cfg, "fused_optimizer", None) is not None else use_cuda()
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay, fused=fused or None,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: Any, total_steps: int):
    """Linear warmup over ``warmup_steps`` optimiser steps, then constant, linear or cosine decay
    to 0 at ``total_steps`` (``cfg.lr_schedule``)."""
    warmup = max(0, int(cfg.warmup_steps))
    schedule = getattr(cfg, "lr_schedule", "constant")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def skip_cpu_shm_op(deepspeed: Any) -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (C++, OpenMP) when its comm layer
    starts: ~40 s in the first job on a fresh machine and again for every other virtualenv (the build is
    keyed by include paths), and its bf16 kernels fault without AVX-512. CPU jobs here are one process or a
    few gloo ranks in tests: gloo's own all-reduce does, so DeepSpeed is told the op is unavailable."""
    compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def import_deepspeed():
    """``import deepspeed`` without its autotuner's ``import mlflow``: with mlflow installed (the tracking extra)
    that costs every job process ~1 s (dev box, ``-X importtime``: 1.0 of deepspeed's 2.4 s). Jobs never autotune,
    and MLflow runs are logged by the asset in the Dagster process (``resources/tracking.py``). mlflow stays
    importable afterwards, and an mlflow already imported is left alone."""
    import sys

    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner sets has_mlflow = False
    try:
        import deepspeed
    finally:
        if hidden and sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed


def init_deepspeed(model: torch.nn.Module, cfg: Any, optimizer: torch.optim.Optimizer | None = None,
                   lr_scheduler: Any = None, universal: bool = False):
    """Wrap ``model`` in a DeepSpeed engine; returns the engine (``engine.optimizer``,
    ``engine.lr_scheduler`` hold the wrapped optimiser/scheduler).

    Single process on CPU: gloo backend, env set by ``ensure_single_process_env``.
    """
    ensure_single_process_env()
    deepspeed = import_deepspeed()  # heavy import, job-only

    if not torch.distributed.is_initialized():
        backend = "nccl" if use_cuda() else "gloo"
        if not use_cuda():
            skip_cpu_shm_op(deepspeed)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    if use_cuda():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model = model.to(f"cuda:{os.environ['LOCAL_RANK']}")
    optimizer = optimizer or make_optimizer(model, cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=deepspeed_config(cfg, universal),
    )
    return engine
