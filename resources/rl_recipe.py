"""The RL recipe: the algorithm choices more than one RL stage reads, written once (verl's ``algorithm:`` block,
TRL's ``GRPOConfig``): the advantage estimator, samples per prompt, where the KL term lives and its coefficients,
the baselines the estimator takes (derived from it), and off-policy sampling with its correction.

It is the Dagster resource ``rl_recipe`` shared by ``rollouts``, ``advantages`` and ``policy_checkpoint``, each
taking its part (``rollout_part``, ``advantage_part``, ``policy_part``). Written in a profile's or ``-c`` file's
``resources: {rl_recipe: {...}}`` (validated when the code location builds its resources, before anything runs)
or in a run config's ``resources.rl_recipe.config`` (the launchpad; checked by ``assets.run_rules`` before a
``batchrl run`` or ``execute_assets``, and by Dagster when the first RL step starts). A bad combination is refused
when written, in one line naming the field (``docs/RL.md``).
"""
from __future__ import annotations

from typing import Literal, Optional

import dagster as dg
from pydantic import Field, model_validator

from batchrl.training.algos.names import ADV_ESTIMATOR_NEEDS, KL_KINDS

KL_PLACEMENTS = ("loss", "reward", "none")
# what each placement alone reads: set away from its default under another placement, a field would do nothing
LOSS_FIELDS = ("kl_loss_coef", "kl_loss_type")
REWARD_FIELDS = ("kl_in_reward_coef", "kl_penalty", "kl_ctrl", "target_kl", "kl_horizon")
ADAPTIVE_FIELDS = ("target_kl", "kl_horizon")


def _groups_estimators() -> str:
    return ", ".join(name for name, needs in ADV_ESTIMATOR_NEEDS.items() if "groups" in needs)


class RLRecipe(dg.ConfigurableResource):
    """One RL recipe for the whole loop; each RL stage reads its part. Fields a placement or estimator does not
    use are refused away from their defaults, so a recipe says only what it does."""

    estimator: Literal[tuple(ADV_ESTIMATOR_NEEDS)] = Field(  # type: ignore[valid-type]
        "grpo", description="advantage estimator (training/algos registry): grpo, drgrpo, rloo, "
        "reinforce_plus_plus_baseline compare a prompt's samples (samples_per_prompt >= 2); remax samples one "
        "greedy baseline per prompt; gae trains a critic with the policy")
    samples_per_prompt: int = Field(8, ge=1, description="responses sampled per prompt by rollouts (a group of "
                                    "the group estimators)")
    kl_placement: Literal[KL_PLACEMENTS] = Field(  # type: ignore[valid-type]
        "loss", description="where the KL to the reference (the base model) goes: loss = a term of the policy "
        "update's loss (kl_loss_coef; GRPO's use_kl_loss); reward = subtracted from the token rewards before the "
        "estimator (kl_in_reward_coef; verl's use_kl_in_reward); none = nowhere")
    kl_loss_coef: float = Field(0.01, ge=0, description="kl_placement loss: weight of the KL loss term "
                                "kl_loss_coef * KL(policy || reference) added to the policy loss (TRL's beta)")
    kl_loss_type: Literal[KL_KINDS] = Field(  # type: ignore[valid-type]
        "low_var_kl", description="kl_placement loss: estimator of the KL loss term: k1 'kl', k2 'mse', k3 "
        "'low_var_kl' (clamped to [-10, 10]), 'abs'; a '+' suffix keeps the value with k2's gradient")
    kl_in_reward_coef: float = Field(0.001, ge=0, description="kl_placement reward: beta of token rewards "
                                     "r - beta * KL(rollout policy || reference); the adaptive controller's start "
                                     "value")
    kl_penalty: Literal[KL_KINDS] = Field(  # type: ignore[valid-type]
        "kl", description="kl_placement reward: KL estimator per token in the reward (k1 'kl', k2 'mse', k3 "
        "'low_var_kl', 'abs')")
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed", description="kl_placement reward: fixed keeps kl_in_reward_coef; adaptive steers the KL towards "
        "target_kl, the coefficient carried over from one iteration to the next")
    target_kl: float = Field(0.1, gt=0, description="kl_ctrl adaptive: the KL per token it steers towards")
    kl_horizon: int = Field(10000, gt=0, description="kl_ctrl adaptive: its horizon in samples")
    off_policy_steps: int = Field(0, ge=0, le=1, description="1: one-step off-policy (verl's one_step_off_policy): "
                                  "rollouts sample the promoted policy's parent, one update behind, so the job "
                                  "worker samples the next iteration (the seed `batchrl run --rl-iterations N` "
                                  "announces) while this one's update trains; needs old_logprobs recompute and "
                                  "rollout_is_threshold. 0: on-policy")
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute", description="log pi_old of the update's ratio: recompute = the trainer's own under the weights "
        "before the update (exact on-policy ratio); rollout = the rollout engine's sampled-token log-probs")
    rollout_is_threshold: Optional[float] = Field(
        2.0, gt=0, description="old_logprobs recompute: the loss is reweighted by truncated importance weights "
        "min(pi_old / pi_rollout, this) against the engine's log-probs (engine mismatch, off-policy staleness); "
        "none = off")
    sample_ahead: bool = Field(False, description="on-policy overlap: the policy update samples the next "
                               "iteration's rollouts from its new weights while it exports them (the same samples, "
                               "so the same data version); needs job-worker sampling and a next iteration announced, "
                               "else off and the update's metadata says why")

    @model_validator(mode="after")
    def _estimator_inputs(self):
        if "groups" in ADV_ESTIMATOR_NEEDS[self.estimator] and self.samples_per_prompt < 2:
            raise ValueError(f"estimator {self.estimator} compares the responses of a prompt's group: "
                             f"samples_per_prompt={self.samples_per_prompt} must be >= 2")
        return self

    @model_validator(mode="after")
    def _one_kl_placement(self):
        unused = {"loss": REWARD_FIELDS, "reward": LOSS_FIELDS, "none": LOSS_FIELDS + REWARD_FIELDS}[self.kl_placement]
        changed = _changed(self, unused)
        if changed:
            raise ValueError(f"{', '.join(changed)} set but kl_placement is {self.kl_placement} (the KL term "
                             f"{_placed(self.kl_placement)}), which does not read them: set kl_placement, or leave "
                             "them at their defaults")
        coef = {"loss": "kl_loss_coef", "reward": "kl_in_reward_coef"}.get(self.kl_placement)
        if coef and getattr(self, coef) == 0:
            raise ValueError(f"kl_placement {self.kl_placement} with {coef}: 0 adds no KL: set kl_placement: none "
                             f"(or {coef} > 0)")
        if self.kl_ctrl == "fixed" and _changed(self, ADAPTIVE_FIELDS):
            raise ValueError(f"{', '.join(_changed(self, ADAPTIVE_FIELDS))} set but kl_ctrl is fixed: they steer "
                             "the adaptive KL controller only; set kl_ctrl: adaptive")
        return self

    @model_validator(mode="after")
    def _off_policy_is_corrected(self):
        if not self.off_policy_steps:
            return self
        # the update's ratio is to the policy it starts from (recomputed); the samples' own policy, one update
        # behind, is corrected for by the truncated importance weights against the engine's log-probs
        if self.old_logprobs != "recompute" or self.rollout_is_threshold is None:
            raise ValueError("off_policy_steps 1 samples one update behind the policy being trained: set "
                             "old_logprobs: recompute and rollout_is_threshold (a number) so the staleness is "
                             f"corrected (now old_logprobs {self.old_logprobs}, rollout_is_threshold "
                             f"{self.rollout_is_threshold})")
        if self.critic:
            raise ValueError(f"off_policy_steps 1 with estimator {self.estimator}: the critic's values and returns "
                             f"are on-policy; use a group estimator ({_groups_estimators()})")
        if self.sample_ahead:
            raise ValueError("sample_ahead with off_policy_steps 1: the off-policy rollouts are prefetched already "
                             "(from the published parent); sampling ahead is the on-policy overlap")
        return self

    @property
    def greedy_baseline(self) -> bool:
        """ReMax: rollouts decode one greedy response per prompt, its reward the prompt's baseline."""
        return "reward_baselines" in ADV_ESTIMATOR_NEEDS[self.estimator]

    @property
    def critic(self) -> bool:
        """GAE: advantages take a critic's values, and the policy update trains that critic."""
        return "values" in ADV_ESTIMATOR_NEEDS[self.estimator]

    def rollout_part(self) -> dict:
        """What ``rollouts`` samples by (and records in its lineage)."""
        return {"samples_per_prompt": self.samples_per_prompt, "greedy_baseline": self.greedy_baseline,
                "off_policy_steps": self.off_policy_steps, "sample_ahead": self.sample_ahead}

    def advantage_part(self) -> dict:
        """``training.rl.advantages.AdvantageSettings``' fields from the recipe."""
        return {"estimator": self.estimator, "use_kl_in_reward": self.kl_placement == "reward",
                **{name: getattr(self, name) for name in REWARD_FIELDS}}

    def policy_part(self) -> dict:
        """``training.trainer.config.PolicyConfig``'s fields from the recipe (no KL loss unless placed there)."""
        return {"adv_estimator": self.estimator, "critic": self.critic,
                "kl_loss_coef": self.kl_loss_coef if self.kl_placement == "loss" else 0.0,
                "kl_loss_type": self.kl_loss_type, "old_logprobs": self.old_logprobs,
                "rollout_is_threshold": self.rollout_is_threshold}


def _changed(recipe: RLRecipe, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if getattr(recipe, name) != type(recipe).model_fields[name].default]


def _placed(placement: str) -> str:
    return {"loss": "is a loss term", "reward": "is in the reward", "none": "is nowhere"}[placement]
