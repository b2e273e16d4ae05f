"""What DPO and the policy update share: seeded setup, DeepSpeed engine, resume, step bookkeeping,
periodic atomic checkpoints and the final HF export. The algorithm loops stay in dpo.py / policy.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from batchrl.training.models import lora

from batchrl.training.models import resident_weights
from batchrl.training.timing.phases import PhaseClock, recording
from batchrl.training.trainer.batching import epoch_order, step_micro_batches, steps_per_epoch, world
from batchrl.training.trainer.checkpoint import (export_hf_model, load_checkpoint, needs_universal, read_completion,
                                                 save_checkpoint, seed_everything, write_completion,
                                                 write_train_record)
from batchrl.training.trainer import optimizer_state, resident_trainer
from batchrl.training.trainer.config import TrainerConfig
from batchrl.training.trainer.finite import check_finite_weights, nonfinite_steps
from batchrl.training.trainer.engine import (frozen_base_placement, init_deepspeed, make_optimizer, make_scheduler,
                                            trainer_clips)

Report = Callable[[dict, int], None]


def load_trainable(model_path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from batchrl.training.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_path, dtype=dtype, device=device)
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


def completed_run(cfg: TrainerConfig, *, model_path: str, out_dir: str, inputs: dict[str, str]) -> dict | None:
    """The result of this very run (same ``run_key``) if it already finished in ``out_dir`` and its
    exports are still there, else None. A finished run keeps no engine/optimiser checkpoint (the HF
    export is its output), so this is what makes re-running a finished job cheap and identical."""
    if not cfg.resume:
        return None
    record = read_completion(os.path.join(out_dir, "checkpoints"))
    result = record.get("result", {})
    exports = [os.path.join(out_dir, "model")] + [v for k, v in result.items() if k.endswith("_dir")]
    if record.get("run_key") != run_key(cfg, model_path, inputs) or not all(map(os.path.isdir, exports)):
        return None
    return {**result, "completed_earlier": True}


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


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` each decoder layer in place (regional compilation: one layer's graph serves
    all layers; the embedding, LM head and loss stay eager). Returns the number of layers."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        layer.compile(backend=backend, dynamic=None)
    return len(layers)


def compute_autocast(cfg: TrainerConfig, device: torch.device):
    """bf16 autocast under ``precision: bf16_amp`` on a GPU, else nothing (CPU stays fp32)."""
    from batchrl.training.trainer.engine import gpu_precision

    if gpu_precision(cfg) == "bf16_amp" and torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_module(engine: Any, cfg: TrainerConfig) -> Any:
    """What training's forward passes call: the engine's module, directly — DeepSpeed's forward turns
    autocast off inside itself, so ``compute_autocast``'s bf16 would not reach the matmuls (the reward
    model's steps ran in fp32 on the H200: 3.4x the GPU time per step). At ZeRO-3 the engine itself: its
    forward gathers the partitioned weights, tied ones included (``gpu_precision``: bf16 there). Backward
    and the optimiser always go through the engine."""
    return engine if cfg.zero_stage == 3 else engine.module


class TrainLoop:
    """Owns the engine and the data position ``(epoch, step_in_epoch, global_step)``.

    ``history`` holds every step's metrics since step 0 (restored on resume), so a resumed run
    returns the same loss curve as an uninterrupted one.

    With ``cfg.lora_rank > 0`` the model is the base (``lora_base``, frozen) with LoRA adapters of
    ``task_type`` (a new adapter, or the one ``model_path`` holds, trained further); only the adapters are
    optimised, checkpointed and exported (``training/models/lora.py``).

    ``resident_trainer_ok`` (the policy update): the job worker's last policy engine is taken over when this job
    trains the checkpoint it exported (``resident_trainer``); any other trainer releases that engine first.
    """

    def __init__(self, cfg: TrainerConfig, *, model_path: str, out_dir: str, total_steps: int,
                 inputs: dict[str, str] | None = None, report: Report | None = None,
                 load_model: Callable[..., tuple[Any, Any]] = load_trainable, task_type: str = lora.CAUSAL_LM,
                 resident_trainer_ok: bool = False):
        self.cfg, self.out_dir, self.total_steps, self.model_path = cfg, out_dir, total_steps, model_path
        self._clock = PhaseClock()  # where the job's wall time went (metadata: a GPU's idle parts)
        self._steps_from: float | None = None
        self.run_key = run_key(cfg, model_path, inputs or {})
        self.report = report or (lambda metrics, step: None)
        self.ckpt_dir = os.path.join(out_dir, "checkpoints")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        seed_everything(cfg.seed)
        self.lora_base: str | None = None  # the frozen base folder of a LoRA run
        # the last policy job's engine, when this job trains the very checkpoint it exported (resident_trainer)
        kept = resident_trainer.claim(cfg, model_path, self.ckpt_dir) if resident_trainer_ok else None
        if not resident_trainer_ok:
            resident_trainer.release()  # another trainer: the memory a kept policy trainer holds is this job's
        self.trainer_reused = kept is not None
        if kept is not None:
            self.tokenizer, self.lora_base = kept.tokenizer, kept.lora_base
            self.engine = resident_trainer.renew(kept, cfg, total_steps)
        else:
            self.engine = self._new_engine(cfg, model_path, total_steps, load_model, task_type)
        seed_everything(cfg.seed)  # the steps' random stream whatever the build drew (a LoRA layer's init): as claimed
        self.state: dict[str, Any] = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "history": [],
                                      "run_key": self.run_key, "world_size": world()[1]}
        self.resumed_from: int | None = None
        # carry_optimizer_state: the AdamW step count taken up from model_path's checkpoint (None: a new AdamW)
        self.optimizer_carried_from: int | None = None
        self.optimizer_state_step: int | None = None  # the step count the export's optimiser state holds
        if getattr(cfg, "carry_optimizer_state", False):
            self.optimizer_carried_from = optimizer_state.load(self.engine.optimizer, self.engine.module, model_path)
        self._lr, self._grad_norm = float("nan"), None
        self._sums: dict[str, Any] = {}  # this step's metrics so far (device tensors)
        self._pending: list[tuple[int, dict]] = []  # finished steps whose metrics the host has not read yet
        if cfg.resume:
            restored = load_checkpoint(self.engine, self.ckpt_dir, zero_stage=cfg.zero_stage,
                                       trainable_only=self.lora_base is not None)
            if restored is not None:
                if restored.get("run_key") != self.run_key:
                    raise ValueError(f"{self.ckpt_dir} holds checkpoints of another run (config or inputs "
                                     "differ); use a fresh out_dir or resume=False")
                self.state = restored
                self.resumed_from = restored["global_step"]
        self._t0 = time.time()
        self._clock.add("setup", time.perf_counter() - self._clock.started)  # model load, compile, engine, resume

    def _new_engine(self, cfg: TrainerConfig, model_path: str, total_steps: int,
                    load_model: Callable[..., tuple[Any, Any]], task_type: str):
        if lora.enabled(cfg):
            model, self.tokenizer, self.lora_base = lora.trainable(load_model, model_path, cfg, task_type,
                                                                   frozen_base_placement(cfg))
        else:
            model, self.tokenizer = load_model(model_path)  # a causal LM, or e.g. a reward model's classifier
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.torch_compile:
            compile_layers(model)
        optimizer = make_optimizer(model, cfg)
        scheduler = make_scheduler(optimizer, cfg, total_steps)
        universal = cfg.resume and needs_universal(self.ckpt_dir, cfg.zero_stage)
        return init_deepspeed(model, cfg, optimizer, scheduler, universal=universal)

    @property
    def global_step(self) -> int:
        return self.state["global_step"]

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def model(self) -> Any:
        """What the forward passes call (``forward_module``)."""
        return forward_module(self.engine, self.cfg)

    def finished(self) -> bool:
        stop = self.cfg.stop_after_steps
        return self.global_step >= self.total_steps or (stop is not None and self.global_step >= stop)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch and call ``engine.step()`` (DeepSpeed applies the optimiser only
        at the accumulation boundary, every ``grad_accum`` calls; it also clips there)."""
        if self._steps_from is None:
            self._steps_from = time.perf_counter()
        boundary = self.engine.is_gradient_accumulation_boundary()
        with torch.profiler.record_function("batchrl/backward"):
            self.engine.backward(loss)
        if boundary:
            self._lr = float(self.engine.get_lr()[0])
            self._grad_norm = None
            if self.cfg.zero_stage == 0:  # DeepSpeed reports no norm without ZeRO: measure (and clip) here
                params = [p for p in self.engine.module.parameters() if p.grad is not None]
                if trainer_clips(self.cfg):  # foreach kernels, no host sync
                    self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm, foreach=True)
                    self._skip_if_nonfinite(params, self._grad_norm)
                else:
                    self._grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        with torch.profiler.record_function("batchrl/optimizer_step"):
            self.engine.step()
        if boundary and self._grad_norm is None:
            self._grad_norm = self.engine.get_global_grad_norm()

    def _skip_if_nonfinite(self, params: list[torch.nn.Parameter], norm: torch.Tensor) -> None:
        """A step whose gradients hold a NaN or an inf (their global norm is not finite) leaves the weights and the
        optimiser's moments as they were, as verl and Megatron skip such steps: one such step would otherwise make
        every weight NaN. The fused AdamW (GPUs) skips it on the device through its ``found_inf`` (no host sync);
        the per-parameter AdamW (CPU, where reading the norm costs nothing) gets no gradients. Recorded per step as
        ``skipped_nonfinite`` (``nonfinite_steps`` in the summary)."""
        bad = (~torch.isfinite(norm)).float()
        optimizer = self.engine.optimizer
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer.defaults.get("fused"):
            optimizer.found_inf = bad
        elif bad.item():
            for p in params:
                p.grad = None
        self._sums["skipped_nonfinite"] = bad

    def forward_context(self):
        """Autocast to bf16 around forward passes (of ``model``) under ``precision: bf16_amp`` on GPUs."""
        return compute_autocast(self.cfg, self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a part of the job into ``phase_s/<name>`` of its result (added up over repeats)."""
        with self._clock.phase(name):
            yield

    def measure_context(self, phase: str = "measure"):
        """Forward passes outside the training steps (margins before/after, fixed log-probs): autocast as in
        training, and eager under ``torch_compile``: no-grad passes would compile a second set of graphs
        (~14 s at the 0.5B shape on an H200, once per job) for passes that run once or twice. Timed as ``phase``."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.phase(phase))
        stack.enter_context(recording(self._clock))  # a model loaded inside: its own load_model phase
        stack.enter_context(self.forward_context())
        if self.cfg.torch_compile:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        return stack

    def accumulate(self, parts: dict[str, Any]) -> None:
        """Add one micro-batch's metrics / grad_accum to this step's; tensors stay on the device."""
        for key, value in parts.items():
            value = value.detach().float() if torch.is_tensor(value) else float(value)
            self._sums[key] = self._sums.get(key, 0.0) + value / self.cfg.grad_accum

    def step_stats(self) -> dict[str, Any]:
        """Pre-clip gradient norm and learning rate of the optimiser step just taken."""
        norm = self._grad_norm
        return {"grad_norm": norm if norm is not None else float("nan"), "lr": self._lr}

    def end_step(self, extra: dict[str, Any], *, epoch: int, step_in_epoch: int) -> None:
        """Record one optimiser step (the accumulated metrics, step stats and ``extra``): data position,
        metrics read by the host every ``metrics_every`` steps (and before a checkpoint), periodic checkpoint."""
        metrics, self._sums = {**self._sums, **self.step_stats(), **extra}, {}
        self.state.update(epoch=epoch, step_in_epoch=step_in_epoch, global_step=self.global_step + 1)
        self._pending.append((self.global_step, metrics))
        every = self.cfg.save_every
        # periodic saves, and a stop before the end (resumed later); a run that reaches its end exports its
        # weights instead (``complete``): the engine + optimiser state (~12 bytes/parameter) would only be
        # written to be deleted
        stopped_early = self.finished() and self.global_step < self.total_steps
        save = bool(every and self.global_step % every == 0) or stopped_early
        if save or self.global_step % self.cfg.metrics_every == 0:
            self.flush_metrics()
        if save:
            self.save()

    def flush_metrics(self) -> None:
        """Read the pending steps' metrics in one host sync (averaged over ranks), record and report them."""
        if not self._pending:
            return
        flat = [value for _, metrics in self._pending for value in metrics.values()]
        on_device = [i for i, v in enumerate(flat) if torch.is_tensor(v)]
        values = [float(v) if not torch.is_tensor(v) else 0.0 for v in flat]
        if on_device:
            read = torch.stack([flat[i].reshape(()).double() for i in on_device]).tolist()
            for i, value in zip(on_device, read):
                values[i] = value
        values = self._mean_over_ranks(values)
        for step, metrics in self._pending:
            record, values = dict(zip(metrics, values[:len(metrics)])), values[len(metrics):]
            self.state["history"].append(record)
            self.report(record, step)
        self._pending = []

    def _mean_over_ranks(self, values: list[float]) -> list[float]:
        size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if size == 1:
            return values
        reduced = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(reduced)
        return (reduced / size).tolist()

    def next_epoch(self, epoch: int) -> None:
        self.state.update(epoch=epoch + 1, step_in_epoch=0)

    def steps(self, n: int, epochs: int, lengths: Sequence[int] | None = None) -> Iterator[list]:
        """The trainers' one epoch/step loop over ``n`` examples, from where the run stands (a resumed run
        skips what it did): each optimiser step yields its micro-batches — this rank's index arrays
        (``step_micro_batches`` of the epoch's seeded order, grouped by ``lengths`` when given) — and, once the
        caller has run them, is recorded (``end_step``); stops at ``finished``."""
        n_steps = steps_per_epoch(n, self.cfg.micro_batch_size, self.cfg.grad_accum)
        for epoch in range(self.state["epoch"], epochs):
            order = epoch_order(n, self.cfg.seed, epoch)
            for step in range(self.state["step_in_epoch"], n_steps):
                if self.finished():
                    break
                yield step_micro_batches(order, step, self.cfg.micro_batch_size, self.cfg.grad_accum, lengths)
                self.end_step({"epoch": epoch}, epoch=epoch, step_in_epoch=step + 1)
            if self.finished():
                break
            self.next_epoch(epoch)

    def save(self) -> str:
        self.flush_metrics()  # the history in the checkpoint holds every step taken
        return save_checkpoint(self.engine, self.ckpt_dir, self.global_step, self.state,
                               keep_last=self.cfg.keep_last, trainable_only=self.lora_base is not None)

    def export(self, extra_metadata: dict[str, Any]) -> str:
        self.engine.module.config.use_cache = True  # off only for training; generation wants the KV cache
        out, record = os.path.join(self.out_dir, "model"), {"config": self.cfg.model_dump(), **extra_metadata}
        with self.phase("export"):
            if self.cfg.zero_stage < 3:  # ZeRO-3: each rank holds a shard only
                self.flush_metrics()
                check_finite_weights(self.engine.module, self.state["history"])
            if self.lora_base is None:
                export_hf_model(self.engine, self.tokenizer, out, record)
                if self.cfg.zero_stage < 3 and world()[1] == 1:  # whole, plain weights: the next job may copy them
                    resident_weights.offer(out, self.engine.module)
            else:
                write_train_record(out, {**record, "adapter_base": lora.base_reference(self.lora_base)})
                out = lora.save_adapter(self.engine, out, self.lora_base)  # the adapter only: MBs, not the base
            if getattr(self.cfg, "carry_optimizer_state", False) and world()[0] == 0:  # for the next update
                self.optimizer_state_step = optimizer_state.save(self.engine.optimizer, self.engine.module, out)
            return out

    def complete(self, result: dict[str, Any]) -> dict[str, Any]:
        """Record a finished run's result next to its checkpoints (``completed_run`` reads it back); a run
        stopped early (``stop_after_steps``) resumes from its checkpoint instead."""
        result["phase_s"] = self._clock.summary()  # "other": tokenisation, data loading, checkpoints
        if self.lora_base is not None:  # lineage: the base the adapter applies to (its data version for an artifact)
            result.update(lora_rank=self.cfg.lora_rank, adapter_base=lora.base_reference(self.lora_base))
            if os.path.isdir(result.get("model_dir") or ""):
                result["adapter_bytes"] = lora.adapter_bytes(result["model_dir"])
        if not result["stopped_early"]:
            write_completion(self.ckpt_dir, self.run_key, result)
        return result

    def summary(self) -> dict[str, Any]:
        self.flush_metrics()  # reads the last steps' metrics: the device has finished them
        if self._steps_from is not None and "steps" not in self._clock.seconds:
            self._clock.add("steps", time.perf_counter() - self._steps_from)
        hist = self.state["history"]
        return {"global_step": self.global_step, "total_steps": self.total_steps,
                "nonfinite_steps": nonfinite_steps(hist),
                "optimizer_steps": int(self.engine.global_steps),  # DeepSpeed's own count
                "stopped_early": self.global_step < self.total_steps, "world_size": world()[1],
                "resumed_from_step": self.resumed_from, "wall_s": round(time.time() - self._t0, 3),
                "loss_curve": [h.get("loss") for h in hist],
                "final": hist[-1] if hist else {}}
