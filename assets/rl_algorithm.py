"""What the RL assets need from lineage for KL in the reward and critic values: the reference model, the KL
controller's state carried over from the previous iteration (through the promoted policy), the rollouts' token
limit (DAPO's overlong punishment), and the critic the advantages were valued with (where the KL term lives is the
RL recipe's ``kl_placement``)."""
from __future__ import annotations

from typing import Any

import dagster as dg

from batchrl.assets.common import as_ref
from batchrl.resources import Artifact, ArtifactRef, StorageResource
from batchrl.training.rl.advantages import AdvantageSettings

_CONTROLLER_FIELDS = ("kl_ctrl", "target_kl", "kl_horizon", "kl_penalty")


def response_length_limit(rollouts: Artifact) -> int | None:
    """The token limit the rollouts were sampled under (the L_max of DAPO's overlong punishment): an agent's
    ``max_total_tokens`` (a trajectory's tokens, the observations' included), else the engine's
    ``max_new_tokens``; None when their lineage names neither."""
    config = rollouts.lineage.get("config", {})
    limit = (config.get("agent") or {}).get("max_total_tokens") or (config.get("engine") or {}).get("max_new_tokens")
    return None if limit is None else int(limit)


def _previous_kl_state(storage: StorageResource, settings: AdvantageSettings, base_model: Artifact,
                       promoted: Artifact | None) -> tuple[float | None, ArtifactRef | None]:
    """The adaptive controller's value after the advantages batch the promoted policy was trained on (an
    edge of the graph: promoted_policy -> its lineage input ``advantages``), when that policy belongs to
    this base model's chain and used the same controller settings; (None, None) otherwise."""
    from batchrl.assets.policy_chain import chain_base

    if settings.kl_ctrl != "adaptive" or promoted is None or chain_base(promoted) != base_model.data_version:
        return None, None
    previous = promoted.input_ref("advantages")
    if previous is None:
        return None, None
    config = storage.read_lineage(previous).get("config", {})
    state = config.get("kl_ctrl_state")
    if state is None or not all(config.get(k) == getattr(settings, k) for k in _CONTROLLER_FIELDS):
        return None, None
    return float(state["kl_coef_next"]), previous


def kl_in_reward_inputs(context: dg.AssetExecutionContext, storage: StorageResource, settings: AdvantageSettings,
                        columns: list[str], base_model: Artifact,
                        promoted: Artifact | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the advantages job needs for KL in the reward (the reference model, the KL coefficient carried
    over) and the extra lineage inputs (reference model, the batch the controller state came from);
    ``({}, {})`` unless the recipe places the KL in the reward. ``columns``: the scored samples' columns."""
    if not settings.use_kl_in_reward:
        return {}, {}
    if "rollout_logprobs" not in columns:
        raise dg.Failure("advantages: kl_placement reward needs the rollouts' rollout_logprobs column")
    carried, previous = _previous_kl_state(storage, settings, base_model, promoted)
    inputs: dict[str, Any] = {"reference": base_model}
    if previous is not None:
        inputs["kl_ctrl_from"] = previous
        context.log.info(f"advantages: adaptive KL coefficient {carried:.6g} carried over from "
                         f"advantages {previous.data_version}")
    return {"reference_model_path": base_model.path, "kl_in_reward_coef": carried}, inputs


CRITIC_ASSET = "critic_checkpoint"


def critic_for_rewards(storage: StorageResource, rewards: Artifact, init: str = "policy",
                       reward_model: Artifact | None = None) -> ArtifactRef:
    """The critic that values the samples behind ``rewards``: the critic exported with the policy
    that sampled them (its ``companions.json``), else a new one from that policy (``init="policy"``)
    or from the reward model (``"reward_model"``: the one the rewards used, else the latest materialised —
    the rewards need not weigh it; ``trainer.critic.load_value_model``)."""
    import json
    import os

    inputs = rewards.lineage["inputs"]
    policy = as_ref(storage.read_lineage(as_ref(inputs["rollouts"]))["inputs"]["policy"])  # two steps up
    companions = os.path.join(storage.localize(policy), "companions.json")
    if os.path.exists(companions):
        with open(companions) as f:
            critic = json.load(f).get(CRITIC_ASSET)
        if critic is not None:
            return as_ref(critic)
    if init != "reward_model":
        return policy
    if "reward_model" in inputs:
        return as_ref(inputs["reward_model"])
    if reward_model is None:
        raise dg.Failure("advantages: critic_init reward_model, but no reward model has been materialised: "
                         "materialise reward_model first, or critic_init: policy")
    return as_ref(reward_model)


def critic_inputs(storage: StorageResource, settings: AdvantageSettings, rewards: Artifact,
                  reward_model: Artifact | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The critic the advantages job takes values from when the estimator needs them, and the lineage input
    naming it; ``({}, {})`` otherwise."""
    from batchrl.training.algos import estimator_needs

    if "values" not in estimator_needs(settings.estimator):
        return {}, {}
    critic = critic_for_rewards(storage, rewards, settings.critic_init, reward_model)
    return {"critic_path": storage.localize(critic)}, {"critic": critic}


def critic_job_inputs(storage: StorageResource, advantages: Artifact, use_critic: bool) -> tuple[dict, dict]:
    """(extra job config, companion artifacts) of the policy update: the critic the advantages were
    valued with is trained further and published as ``critic_checkpoint``."""
    critic = advantages.lineage.get("inputs", {}).get("critic")
    if not use_critic:
        return {}, {}
    if critic is None:  # an advantages batch from an earlier run with another estimator
        raise dg.Failure("policy_checkpoint: rl_recipe.estimator trains a critic but the advantages were computed "
                         "without critic values: rematerialise advantages with this recipe")
    return ({"critic_path": storage.localize(critic)},
            {CRITIC_ASSET: ("critic", {"advantages": advantages, "critic": critic})})
