"""What DPO and the policy update share: seeded setup, DeepSpeed engine, resume, step bookkeeping,
periodic atomic checkpoints and the final HF export. The algorithm loops stay in dpo.py / policy.py.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable

import torch

from batchrl.training.trainer.batching import world
from batchrl.training.trainer.checkpoint import (export_hf_model, load_checkpoint, save_checkpoint,
                                                 seed_everything)
from batchrl.training.trainer.config import TrainerConfig
from batchrl.training.trainer.engine import init_deepspeed, make_optimizer, make_scheduler

Report = Callable[[dict, int], None]


def load_trainable(model_path: str):
    from batchrl.training.tiny_model import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_path, dtype=torch.float32, device="cpu")
    model.config.use_cache = False
    return model.train(), tokenizer


# settings that may change between a run and its resumption
RESUMABLE_FIELDS = {"resume", "stop_after_steps", "save_every", "keep_last"}


def run_key(cfg: TrainerConfig, model_path: str, inputs: dict[str, str]) -> str:
    """Identity of a training run: config (minus resumable settings), start model, input file hashes."""
    # with a global batch, grad_accum follows the number of ranks: a run may resume on another N
    exclude = RESUMABLE_FIELDS | ({"grad_accum"} if cfg.global_batch_size else set())
    h = hashlib.sha256(cfg.model_dump_json(exclude=exclude).encode())
    h.update(os.path.abspath(model_path).encode())
    for name, path in sorted(inputs.items()):
        with open(path, "rb") as f:
            h.update(name.encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def with_global_batch(cfg: TrainerConfig) -> TrainerConfig:
    """``grad_accum`` from ``global_batch_size`` and the number of ranks (unchanged when it is unset)."""
    if cfg.global_batch_size is None:
        return cfg
    ranks = world()[1]
    per_pass = cfg.micro_batch_size * ranks
    if cfg.global_batch_size % per_pass:
        raise ValueError(f"global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size "
                         f"{cfg.micro_batch_size} x {ranks} ranks")
    return cfg.model_copy(update={"grad_accum": cfg.global_batch_size // per_pass})


def fit_batch(cfg: TrainerConfig, n: int) -> TrainerConfig:
    """Resolve ``global_batch_size``, then shrink micro-batch / accumulation so one optimiser step (over
    all ranks) fits in ``n`` examples (DeepSpeed steps only after exactly ``grad_accum`` backward passes)."""
    cfg = with_global_batch(cfg)
    n = n // world()[1]
    if n >= cfg.micro_batch_size * cfg.grad_accum:
        return cfg
    if n < 1:
        raise ValueError("fewer examples than ranks")
    grad_accum = max(1, min(cfg.grad_accum, n))
    return cfg.model_copy(update={"grad_accum": grad_accum, "micro_batch_size": max(1, n // grad_accum)})


class TrainLoop:
    """Owns the engine and the data position ``(epoch, step_in_epoch, global_step)``.

    ``history`` holds every step's metrics since step 0 (restored on resume), so a resumed run
    returns the same loss curve as an uninterrupted one.
    """

    def __init__(self, cfg: TrainerConfig, *, model_path: str, out_dir: str, total_steps: int,
                 inputs: dict[str, str] | None = None, report: Report | None = None,
                 load_model: Callable[[str], tuple[Any, Any]] = load_trainable):
        self.cfg, self.out_dir, self.total_steps = cfg, out_dir, total_steps
        self.run_key = run_key(cfg, model_path, inputs or {})
        self.report = report or (lambda metrics, step: None)
        self.ckpt_dir = os.path.join(out_dir, "checkpoints")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        seed_everything(cfg.seed)
        model, self.tokenizer = load_model(model_path)  # a causal LM, or e.g. a reward model's classifier
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = make_optimizer(model, cfg)
        scheduler = make_scheduler(optimizer, cfg, total_steps)
        self.engine = init_deepspeed(model, cfg, optimizer, scheduler)
        self.state: dict[str, Any] = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "history": [],
                                      "run_key": self.run_key, "world_size": world()[1]}
        self.resumed_from: int | None = None
        self._lr, self._grad_norm = float("nan"), None
        if cfg.resume:
            restored = load_checkpoint(self.engine, self.ckpt_dir, zero_stage=cfg.zero_stage)
            if restored is not None:
                if restored.get("run_key") != self.run_key:
                    raise ValueError(f"{self.ckpt_dir} holds checkpoints of another run (config or inputs "
                                     "differ); use a fresh out_dir or resume=False")
                self.state = restored
                self.resumed_from = restored["global_step"]
        self._t0 = time.time()

    @property
    def global_step(self) -> int:
        return self.state["global_step"]

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def finished(self) -> bool:
        stop = self.cfg.stop_after_steps
        return self.global_step >= self.total_steps or (stop is not None and self.global_step >= stop)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch and call ``engine.step()`` (DeepSpeed applies the optimiser only
        at the accumulation boundary, every ``grad_accum`` calls; it also clips there)."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.backward(loss)
        if boundary:
            self._lr = float(self.engine.get_lr()[0])
            self._grad_norm = None
            if self.cfg.zero_stage == 0:  # DeepSpeed reports no norm without ZeRO: measure it here
                grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
                self._grad_norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.engine.step()
        if boundary and self._grad_norm is None:
            self._grad_norm = self.engine.get_global_grad_norm()

    def step_stats(self) -> dict[str, float]:
        """Pre-clip gradient norm and learning rate of the optimiser step just taken."""
        norm = self._grad_norm
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "lr": self._lr}

    def end_step(self, metrics: dict[str, float], *, epoch: int, step_in_epoch: int) -> None:
        """Record one optimiser step: report, history, data position, periodic checkpoint."""
        self.state.update(epoch=epoch, step_in_epoch=step_in_epoch,
                          global_step=self.global_step + 1)
        metrics = self._mean_over_ranks({k: float(v) for k, v in metrics.items()})
        self.state["history"].append(metrics)
        self.report(metrics, self.global_step)
        every = self.cfg.save_every
        if (every and self.global_step % every == 0) or self.finished():
            self.save()

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if size == 1:
            return metrics
        values = torch.tensor(list(metrics.values()), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(values)
        return dict(zip(metrics, (values / size).tolist()))

    def next_epoch(self, epoch: int) -> None:
        self.state.update(epoch=epoch + 1, step_in_epoch=0)

    def save(self) -> str:
        return save_checkpoint(self.engine, self.ckpt_dir, self.global_step, self.state,
                               keep_last=self.cfg.keep_last)

    def export(self, extra_metadata: dict[str, Any]) -> str:
        self.engine.module.config.use_cache = True  # off only for training; generation wants the KV cache
        return export_hf_model(self.engine, self.tokenizer, os.path.join(self.out_dir, "model"),
                               {"config": self.cfg.model_dump(), **extra_metadata})

    def summary(self) -> dict[str, Any]:
        hist = self.state["history"]
        return {"global_step": self.global_step, "total_steps": self.total_steps,
                "optimizer_steps": int(self.engine.global_steps),  # DeepSpeed's own count
                "stopped_early": self.global_step < self.total_steps,
                "resumed_from_step": self.resumed_from, "wall_s": round(time.time() - self._t0, 3),
                "loss_curve": [h.get("loss") for h in hist],
                "final": hist[-1] if hist else {}}
