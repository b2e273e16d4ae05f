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
    lr: float = Field(1e-3, gt=0, description="peak learning rate of AdamW (reached after warmup_steps)")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    warmup_steps: int = Field(0, ge=0, description="optimiser steps of linear warmup from 0 to lr")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning rate after warmup: constant = stays at lr; linear / cosine = decays to "
        "0 at the last optimiser step")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping: the global gradient norm is scaled "
                                 "down to this")
    micro_batch_size: int = Field(8, ge=1, description="examples per forward/backward pass on one rank")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimiser step (derived from "
                            "global_batch_size when that is set)")
    global_batch_size: int | None = Field(
        None, ge=1, description="examples per optimiser step over all ranks; when set, grad_accum = "
        "global_batch_size / (micro_batch_size x ranks), so the update is the same on 1 or N GPUs")
    max_length: int = Field(256, ge=8, description="tokens per sequence (prompt + completion); longer ones are "
                            "truncated")
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
    seed: int = Field(0, description="seed of the python/numpy/torch RNGs and of the data order: the same inputs, "
                      "config and seed give the same bytes")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage (0-3); a run at ZeRO 1-3 resumes "
                                            "only on the same number of ranks")
    precision: Literal["fp32", "bf16", "bf16_amp"] = Field(
        "bf16_amp", description="GPU only (CPU stays fp32): bf16_amp = fp32 weights, bf16 autocast compute, no "
        "second copy (the fastest on one H200, bench/RESULTS.md; runs as bf16 at ZeRO-3, whose engine forward turns "
        "autocast off); bf16 = bf16 weights with DeepSpeed's fp32 master copy; fp32 = no bf16 at all")
    num_gpus: int = Field(1, ge=1, description="not read by the trainer: the ranks a job runs on are the trainer "
                          "resource's num_gpus (resources.trainer.config.num_gpus); part of the run's identity only")
    # checkpoints
    save_every: int = Field(0, ge=0, description="optimiser steps between checkpoints; 0 = only at the end")
    keep_last: int = Field(2, ge=1, description="trainer checkpoints kept in the work folder (older ones deleted)")
    resume: bool = Field(True, description="continue from the work folder's latest checkpoint "
                         "(out_dir/checkpoints/latest) when present")
    stop_after_steps: int | None = Field(None, ge=1, description="stop early (as if killed) after this many "
                                         "optimiser steps in all")
    # LoRA (peft): adapters on the frozen base; the checkpoint is the adapter only (training/models/lora.py)
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
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="probability that a preference label is flipped "
                                   "(robust / cDPO); 0 = plain DPO")
    epochs: int = Field(3, ge=1, description="passes over the DPO pairs")
    lr: float = Field(5e-4, gt=0)
    micro_batch_size: int = Field(8, ge=1, description="preference pairs per micro-batch on one rank (chosen and "
                                  "rejected: twice as many sequences per forward pass)")

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
    epochs: int = Field(3, ge=1, description="passes over the feedback rows")
    lr: float = Field(5e-4, gt=0)
    micro_batch_size: int = Field(8, ge=2, description="rows per micro-batch (at least 2: the reference point "
                                  "pairs each prompt with another row's completion)")
    max_rows: int | None = Field(None, ge=2, description="train on a seeded sample of this many feedback rows "
                                 "(smoke-size runs of a large model on CPU); all when unset")


class RewardModelConfig(TrainerConfig):
    """Bradley-Terry reward model: a scalar head on the base model, ``-log σ(r_chosen − r_rejected)``.
    ``max_pairs`` trains on a seeded sample of that many pairs (smoke-size runs); None = all."""

    epochs: int = Field(3, ge=1, description="passes over the reward model's preference pairs")
    lr: float = Field(1e-3, gt=0)
    micro_batch_size: int = Field(16, ge=1, description="pairs per micro-batch on one rank (2x sequences per "
                                  "forward pass of the reward model)")
    max_pairs: int | None = Field(None, ge=1, description="train on a seeded sample of this many preference pairs "
                                  "(smoke-size runs); all when unset")


class PolicyUpdateConfig(TrainerConfig):
    """What ``ops.policy_checkpoint.config`` holds: the PPO/GRPO-style update's own knobs (verl ``core_algos``
    conventions). The estimator, the critic, the KL loss and the off-policy correction are the RL recipe's
    (``resources.rl_recipe``), joined in ``PolicyConfig``."""

    policy_loss: Literal[POLICY_LOSS_NAMES] = Field(  # type: ignore[valid-type]
        "vanilla", description="policy-gradient loss: vanilla = PPO clipped surrogate with dual clip, gspo = its "
        "sequence-level ratio, weighted_regression = weights times log-likelihood, no ratio (AWR/RWR)")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: lower bound 1 - clip_ratio_low of the "
                                  "importance ratio")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: upper bound 1 + clip_ratio_high of the "
                                   "importance ratio")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip constant c (> 1) bounding the loss of negative "
                                "advantages")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses become one: token-mean = mean over all response tokens; "
        "seq-mean-token-sum / seq-mean-token-mean = each sequence's token sum / token mean, averaged over sequences; "
        "seq-mean-token-sum-norm = that mean of token sums divided by the padded length (Dr. GRPO)")
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus (subtracted from the loss)")
    ppo_epochs: int = Field(1, ge=1, description="passes over the rollout batch per policy update")
    group_by_length: bool = Field(False, description="sort each optimiser step's rollouts by length before cutting "
                                  "micro-batches; off by default: token-mean losses weight tokens per micro-batch, so "
                                  "regrouping changes the update")
    pack_samples: bool = Field(False, description="lay each micro-batch's rollouts end to end in a few rows "
                               "(position ids restarting per sequence, no attention across them) instead of padding "
                               "every one to the longest, and run the LM head on completion tokens only: the same "
                               "update up to float rounding, fewer tokens computed when lengths are ragged (eager "
                               "only: not with torch_compile)")
    temperature: float = Field(1.0, gt=0, description="the temperature the rollouts were sampled at; the policy's "
                               "log-probs are computed at it (keep it equal to the rollout engine's)")
    carry_optimizer_state: bool = Field(
        False, description="take up AdamW's moments and step count from the update that produced the policy trained "
        "here (published with its checkpoint, in its data version), as one optimiser over the RL iterations (verl, "
        "TRL) instead of a new one each iteration; 8 bytes per trainable parameter per checkpoint; needs zero_stage "
        "0 and precision fp32 or bf16_amp")
    lr: float = Field(1e-3, gt=0)
    micro_batch_size: int = Field(16, ge=1)
    # critic (PPO with GAE, rl_recipe.estimator gae): a value model trained after the policy in the same job
    critic_lr: float = Field(1e-3, gt=0, description="learning rate of the critic (value model)")
    cliprange_value: float = Field(0.5, gt=0, description="value clip around the batch's old values")

    @model_validator(mode="after")
    def _carried_state_is_the_trainers(self):
        # ZeRO partitions AdamW's state and DeepSpeed's bf16 optimiser keeps its own fp32 copies of the weights
        if self.carry_optimizer_state and (self.zero_stage or self.precision == "bf16"):
            raise ValueError(f"carry_optimizer_state: true needs the trainer's own AdamW over the model's parameters: "
                             f"zero_stage 0 (got {self.zero_stage}) and precision fp32 or bf16_amp (got "
                             f"{self.precision!r})")
        return self

    @model_validator(mode="after")
    def _packing_is_eager(self):
        # packed rows change shape every micro-batch: compiled layers recompile each time, far slower than padded
        # rows (bench/check_packing_gpu.py)
        if self.pack_samples and self.torch_compile:
            raise ValueError("pack_samples: true with torch_compile: true recompiles the layers for every packed "
                             "shape (slower than either alone): pick one")
        return self


class PolicyConfig(PolicyUpdateConfig):
    """The policy trainer job's config: the update's knobs with the RL recipe's part (``RLRecipe.policy_part``).

    KL to the reference is a loss term ``kl_loss_coef * KL`` (none at 0: the recipe puts the KL in the reward, or
    nowhere). ``adv_estimator`` names the estimator the batch's advantages were computed with; the update itself
    reads the per-token advantages from its input batch.
    """

    adv_estimator: Literal[tuple(ADV_ESTIMATOR_NEEDS)] = Field(  # type: ignore[valid-type]
        "grpo", description="the estimator the batch's advantages were computed with (rl_recipe.estimator); gae "
        "needs critic: true")
    critic: bool = Field(False, description="train a value model on the batch's returns (clipped value loss); the "
                         "recipe sets it for gae")
    kl_loss_coef: float = Field(0.01, ge=0, description="weight of the loss term kl_loss_coef * KL(policy || "
                                "reference) (rl_recipe.kl_loss_coef); 0 = no term")
    kl_loss_type: Literal[KL_KINDS] = Field(  # type: ignore[valid-type]
        "low_var_kl", description="estimator of the KL loss term (rl_recipe.kl_loss_type)")
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute", description="log pi_old of the ratio (rl_recipe.old_logprobs): recompute = the trainer's own "
        "under the weights before the update; rollout = the rollout engine's sampled-token log-probs")
    rollout_is_threshold: float | None = Field(2.0, gt=0, description="with old_logprobs recompute and rollout "
                                               "log-probs in the batch: the loss is reweighted by truncated importance "
                                               "weights min(pi_old / pi_rollout, this) for the engine mismatch; "
                                               "none = off")

    @model_validator(mode="after")
    def _critic_matches_estimator(self):
        needs_values = "values" in estimator_needs(self.adv_estimator)
        if needs_values and not self.critic:
            raise ValueError(f"adv_estimator={self.adv_estimator} needs critic values: set critic: true")
        if self.critic and not needs_values:
            raise ValueError(f"critic: true but adv_estimator={self.adv_estimator} does not use values "
                             "(use gae, or critic: false)")
        return self
