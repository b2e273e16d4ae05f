"""Typed trainer configs (pydantic, JSON round-trip). Defaults train the embedded tiny CPU model.

``TrainerConfig`` holds what every DeepSpeed stage shares; ``DPOConfig``, ``RewardModelConfig`` and
``PolicyConfig`` add the algorithm knobs (names follow TRL for DPO and verl for PPO/GRPO so numbers compare with the field).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchrl.training.algos.names import ADV_ESTIMATOR_NEEDS, KL_KINDS, POLICY_LOSS_NAMES
from batchrl.training.algos.registry import estimator_needs

T = TypeVar("T", bound="TrainerConfig")
ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head
LORA_KNOBS = ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save")  # need lora_rank > 0


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # optimisation
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = 0.0
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup, decay to 0 or not
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1)
    grad_accum: int = Field(1, ge=1)
    global_batch_size: int | None = Field(
        None, ge=1, description="examples per optimiser step over all ranks; when set, grad_accum = "
        "global_batch_size / (micro_batch_size x ranks), so the update is the same on 1 or N GPUs")
    max_length: int = Field(256, ge=8)
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward: less memory, "
                                         "~1/3 more compute")
    fused_optimizer: bool | None = Field(None, description="fused AdamW kernel; None = fused on GPUs, the "
                                         "per-parameter loop on CPU (bitwise-stable resume)")
    fused_logprobs: bool = Field(True, description="LM head + log-softmax chunk by chunk from the hidden states "
                                 "(Triton kernels on GPUs): no [batch, tokens, vocab] float32 logits; False = the "
                                 "model's full logits")
    group_by_length: bool = Field(True, description="sort each optimiser step's examples by length before cutting "
                                  "micro-batches (less padding; same examples per step)")
    metrics_every: int = Field(10, ge=1, description="optimiser steps between host reads of the metrics (kept on "
                               "the device in between: no host sync inside a step); every step is still recorded")
    measure_batch_tokens: int = Field(32768, ge=1, description=(
        "token budget of one batch in the passes without gradients (margins or accuracy before/after, the "
        "policy's fixed log-probs): larger batches than training's keep the GPU fed; lower it if those passes "
        "run out of memory"))
    torch_compile: bool = Field(False, description="compile each decoder layer with torch.compile (fuses norms, "
                                "rotary and activations; pays once at start)")
    # reproducibility / engine
    seed: int = 0
    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["fp32", "bf16", "bf16_amp"] = Field(
        "bf16_amp", description="GPU only (CPU stays fp32): bf16_amp = fp32 weights, bf16 autocast compute, no "
        "second copy (the fastest on one H200, bench/RESULTS.md; runs as bf16 at ZeRO-3, whose engine forward turns "
        "autocast off); bf16 = bf16 weights with DeepSpeed's fp32 master copy; fp32 = no bf16 at all")
    num_gpus: int = Field(1, ge=1)  # >1: the job is started by the deepspeed launcher
    # checkpoints
    save_every: int = Field(0, ge=0)  # optimiser steps between checkpoints; 0 = only at the end
    keep_last: int = Field(2, ge=1)
    resume: bool = True  # continue from out_dir/checkpoints/latest when present
    stop_after_steps: int | None = Field(None, ge=1)  # stop early (as if killed) after N total steps
    # LoRA (peft): adapters on the frozen base; the checkpoint is the adapter only (training/lora.py)
    lora_rank: int = Field(0, ge=0, description="LoRA rank r: train low-rank adapters on the frozen base model and "
                           "publish the adapter only (MBs); 0 = full fine-tuning (the default)")
    lora_alpha: int = Field(16, ge=1, description="LoRA scale numerator: the update is (lora_alpha / lora_rank) B A")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input in training")
    lora_target_modules: list[str] = Field(default_factory=lambda: [ALL_LINEAR], description=(
        "modules that get adapters, by name or name suffix (e.g. [q_proj, v_proj]); all-linear = every linear "
        "layer but the output head"))
    lora_modules_to_save: list[str] = Field(default_factory=list, description=(
        "modules trained in full beside the adapters and saved with them (e.g. [embed_tokens]); the reward "
        "model's and critic's new score head always is"))

    @model_validator(mode="after")
    def _lora_fields_need_lora(self):
        if self.lora_rank == 0:
            defaults = {name: type(self).model_fields[name].get_default(call_default_factory=True)
                        for name in LORA_KNOBS}
            changed = sorted(name for name, default in defaults.items() if getattr(self, name) != default)
            if changed:
                raise ValueError(f"{', '.join(changed)} set but lora_rank is 0 (full fine-tuning): set lora_rank > 0 "
                                 "to train LoRA adapters, or leave these at their defaults")
            return self
        targets = self.lora_target_modules
        if not targets or any(not name.strip() for name in targets):
            raise ValueError("lora_target_modules must name at least one module (or be [all-linear])")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"lora_target_modules: {ALL_LINEAR} already covers every linear layer; give it alone")
        if ALL_LINEAR in self.lora_modules_to_save or set(targets) & set(self.lora_modules_to_save):
            raise ValueError("lora_modules_to_save: a module is either adapted (lora_target_modules) or trained in "
                             "full, not both")
        return self

    @model_validator(mode="after")
    def _global_batch_divides(self):
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                             f"{self.micro_batch_size}")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.model_validate_json(text)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        return cls.model_validate(json.loads(Path(path).read_text()))


class DPOConfig(TrainerConfig):
    """Direct Preference Optimisation (TRL conventions: summed completion log-probs)."""

    beta: float = Field(0.1, gt=0, description="DPO/KTO-style temperature; ORPO's lambda; SimPO's beta (2.0-2.5 there)")
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust", "simpo", "orpo"] = Field("sigmoid", description=(
        "sigmoid/hinge/ipo/robust: DPO family against the reference log-probs; simpo, orpo: reference-free "
        "(algos/offline.py: length-normalised log-probs, the reference pass is not used)"))
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin gamma (loss_type simpo only)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    epochs: int = Field(3, ge=1)
    lr: float = Field(5e-4, gt=0)
    micro_batch_size: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _simpo_gamma_needs_simpo(self):
        if self.simpo_gamma != 0.5 and self.loss_type != "simpo":
            raise ValueError(f"simpo_gamma is SimPO's margin but loss_type is {self.loss_type!r}: set loss_type simpo")
        return self


class KTOConfig(TrainerConfig):
    """KTO on unpaired binary feedback (TRL ``KTOTrainer`` conventions: summed completion log-probs; the
    reference point from mismatched pairs, ``trainer/kto.py``)."""

    beta: float = Field(0.1, gt=0, description="temperature of the implicit reward beta * (logp - ref_logp)")
    desirable_weight: float | None = Field(None, gt=0, description=(
        "loss weight of thumbs-up rows (lambda_D); unset = balanced from the data, lambda_D = lambda_U n_U / n_D, "
        "so lambda_D n_D / (lambda_U n_U) = 1 (the paper keeps it in [1, 4/3]; TRL defaults to 1.0, which on "
        "feedback with few thumbs up lets the thumbs down dominate)"))
    undesirable_weight: float = Field(1.0, gt=0, description="loss weight of thumbs-down rows (lambda_U)")
    epochs: int = Field(3, ge=1)
    lr: float = Field(5e-4, gt=0)
    micro_batch_size: int = Field(8, ge=2, description="rows per micro-batch (at least 2: the reference point "
                                  "pairs each prompt with another row's completion)")


class RewardModelConfig(TrainerConfig):
    """Bradley-Terry reward model: a scalar head on the base model, ``-log σ(r_chosen − r_rejected)``.
    ``max_pairs`` trains on a seeded sample of that many pairs (smoke-size runs); None = all."""

    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-3, gt=0)
    micro_batch_size: int = Field(16, ge=1)  # pairs per micro-batch (2x sequences per forward pass)
    max_pairs: int | None = Field(None, ge=1)


class PolicyConfig(TrainerConfig):
    """PPO/GRPO-style policy update on a fixed batch of rollouts (verl ``core_algos`` conventions).

    KL to the reference is a loss term (``kl_coef * k3``) unless ``use_kl_in_reward`` (then it is
    expected folded into the rewards before advantages, and the loss term is off).
    ``adv_estimator`` names the estimator the advantages stage used (``training/advantages.py``);
    the update itself reads the per-token advantages from its input batch.
    """

    # allowed values come from the registries: an unknown name fails when the config is written
    adv_estimator: Literal[tuple(ADV_ESTIMATOR_NEEDS)] = "grpo"  # type: ignore[valid-type]
    policy_loss: Literal[POLICY_LOSS_NAMES] = "vanilla"  # type: ignore[valid-type]
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1)
    kl_coef: float = Field(0.01, ge=0)
    kl_type: Literal[KL_KINDS] = "low_var_kl"  # type: ignore[valid-type]  # k3, clamped to [-10, 10]
    use_kl_in_reward: bool = False
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = 0.0
    ppo_epochs: int = Field(1, ge=1)
    # token-mean losses weight tokens per micro-batch: regrouping would change the update, so off by default
    group_by_length: bool = False
    temperature: float = Field(1.0, gt=0)
    # old log-probs: recompute under the current weights (exact on-policy ratio) or take the rollout
    # engine's with a truncated importance-sampling correction for the engine mismatch.
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    rollout_is_threshold: float | None = Field(2.0, gt=0)
    lr: float = Field(1e-3, gt=0)
    micro_batch_size: int = Field(16, ge=1)
    # critic (PPO with GAE): a value model trained after the policy in the same job, ppo_epochs passes
    critic: bool = Field(False, description="train a value model on the batch's returns (clipped value loss)")
    critic_lr: float = Field(1e-3, gt=0)
    cliprange_value: float = Field(0.5, gt=0, description="value clip around the batch's old values")

    @model_validator(mode="after")
    def _critic_matches_estimator(self):
        needs_values = "values" in estimator_needs(self.adv_estimator)
        if needs_values and not self.critic:
            raise ValueError(f"adv_estimator={self.adv_estimator} needs critic values: set critic: true")
        if self.critic and not needs_values:
            raise ValueError(f"critic: true but adv_estimator={self.adv_estimator} does not use values "
                             "(use gae, or critic: false)")
        return self
