"""The RL loop in the asset graph: ``policy_checkpoint`` → ``promoted_policy`` → ``rollouts``.

Dagster's asset graph is acyclic, and an asset may depend on its own earlier materialisations only when it
is time-partitioned (``TimeWindowPartitionMapping`` with negative offsets): an RL iteration is no time
window. So the loop's back edge is an asset of its own: ``promoted_policy`` (external: no op computes it)
is materialised by ``policy_checkpoint`` when it publishes a checkpoint, and is an input of ``rollouts``
(the policy they sample from) and of ``policy_checkpoint`` (its parent). Every iteration is then a visible
edge, a materialisation of ``promoted_policy`` in the UI (its history is the chain), and in each
checkpoint's lineage the input ``policy`` is its parent checkpoint (the base model for a chain's first).

A chain belongs to one base model: the promoted checkpoint is used only when it descends from the current
``base_model``; a new base model starts a new chain from itself.
"""
from __future__ import annotations

from typing import Optional

import dagster as dg

from batchrl.resources import StorageResource
from batchrl.resources.artifacts import OPTIONAL_KEY, Artifact, make_local
from batchrl.resources.storage import ArtifactRef

PROMOTED = "promoted_policy"
DATA_VERSION_TAG = "dagster/data_version"  # the tag Dagster reads an event's data version from
ITERATION = "iteration"  # numeric metadata of each RL stage: the chain's iteration it belongs to (1 = first)
CHAIN = "chain_base"  # text metadata of each RL stage: the chain it belongs to, "base_model@<data version>"

promoted_policy = dg.AssetSpec(
    PROMOTED, group_name="rl", kinds={"pytorch"},
    description="The policy the next RL iteration starts from: the latest checkpoint policy_checkpoint promoted "
                "(each materialisation names the checkpoint and its parent; the history is the policy chain). "
                "Materialised by policy_checkpoint, read by rollouts (the policy they sample) and by "
                "policy_checkpoint (the parent it trains further).")

# never promoted yet: the input is None and the chain starts from the base model
PROMOTED_POLICY_IN = dg.AssetIn(PROMOTED, metadata={OPTIONAL_KEY: True})


def chain_base(policy: Artifact) -> str:
    """Data version of the base model a policy descends from (a base model is its own chain base)."""
    if policy.asset == "base_model":
        return policy.data_version
    return policy.lineage["inputs"]["reference"]["data_version"]


def current_policy(context: dg.AssetExecutionContext, promoted: Optional[Artifact], base_model: Artifact,
                   choice: str) -> Artifact:
    """The policy to sample from: ``"latest"`` = the promoted checkpoint when it belongs to this base
    model's chain, else the base model (a new chain); ``"base"`` = the base model."""
    if choice not in ("latest", "base"):
        raise dg.Failure(f"rollouts: policy must be 'latest' or 'base', got {choice!r}")
    if choice == "latest" and promoted is not None:
        if chain_base(promoted) == base_model.data_version:
            return promoted
        context.log.info(f"rollouts: the promoted policy {promoted.asset} {promoted.data_version} belongs to "
                         f"another base model; starting a new chain from base_model {base_model.data_version}")
    return base_model


def behaviour_policy(storage: StorageResource, promoted: Artifact, off_policy_steps: int) -> tuple[Artifact, int]:
    """``(the policy to sample from, its staleness)``: ``promoted`` itself on-policy; one-step off-policy, the
    policy it was trained from (its lineage input ``policy``), the base model being its own."""
    if not off_policy_steps or promoted.asset == "base_model":
        return promoted, 0
    trained_from = promoted.input_ref("policy")
    if trained_from is None:
        raise dg.Failure(f"rollouts: off_policy_steps=1 samples from the policy the promoted {promoted.asset} "
                         f"{promoted.data_version} was trained from, but its lineage names none ({promoted.uri})")
    return make_local(storage, trained_from), 1


def parent_policy(rollouts: Artifact, promoted: Optional[Artifact], base_model: Artifact) -> Artifact:
    """The policy the update trains, as one of this step's inputs: the one ``rollouts`` were sampled from (the
    promoted checkpoint or the base model), or, for rollouts one update behind (``staleness`` 1), the promoted
    checkpoint trained from that one; checked to descend from ``base_model`` (the KL reference)."""
    sampled = rollouts.input_ref("policy")
    sampled_chain = rollouts.lineage.get("config", {}).get("chain_base", sampled.data_version)
    if sampled_chain != base_model.data_version:
        raise dg.Failure(f"policy_checkpoint: the rollouts were sampled from {sampled.asset} {sampled.data_version} "
                         f"({sampled.uri}), which descends from another base model than the KL reference "
                         f"base_model {base_model.data_version} ({base_model.uri}): re-materialise rollouts so the "
                         "policy chain and its reference share one base model")
    if rollouts.lineage.get("config", {}).get("staleness"):
        trained_from = promoted.input_ref("policy") if promoted is not None else None
        if trained_from is not None and (trained_from.asset, trained_from.data_version) == \
                (sampled.asset, sampled.data_version):
            return promoted
        now = f"{promoted.asset} {promoted.data_version}" if promoted is not None else "none"
        raise dg.Failure(f"policy_checkpoint: the off-policy rollouts were sampled from {sampled.asset} "
                         f"{sampled.data_version}, which is not the parent of the promoted policy (now {now}): "
                         "re-materialise rollouts, so the update is one step ahead of its samples")
    for candidate in (promoted, base_model):
        if candidate is not None and (candidate.asset, candidate.data_version) == (sampled.asset, sampled.data_version):
            return candidate
    now = f"{promoted.asset} {promoted.data_version}" if promoted is not None else "none"
    raise dg.Failure(f"policy_checkpoint: the rollouts were sampled from {sampled.asset} {sampled.data_version}, "
                     f"which is no longer the promoted policy (now {now}): re-materialise rollouts, so the update "
                     "trains the policy its samples came from")


def promote(context: dg.AssetExecutionContext, output: dg.Output, parent: Artifact, base_model: Artifact,
            extra: dict | None = None) -> None:
    """Materialise ``promoted_policy`` as the checkpoint just published (its data version, its parent, its
    iteration in the chain when known; ``extra``: more metadata, e.g. the chain's chart)."""
    ref = output.value
    iteration = output.metadata.get(ITERATION)
    context.log_event(dg.AssetMaterialization(
        PROMOTED, description=f"policy_checkpoint {ref['data_version']} promoted (parent {parent.asset} "
                              f"{parent.data_version})",
        metadata={"uri": dg.MetadataValue.path(ref["uri"]), "data_version": ref["data_version"],
                  "artifact_asset": "policy_checkpoint", "parent": f"{parent.asset}@{parent.data_version}",
                  CHAIN: f"base_model@{base_model.data_version}", **(extra or {}),
                  **({ITERATION: iteration} if iteration is not None else {})},
        tags={DATA_VERSION_TAG: ref["data_version"]}))


def repromote(context: dg.OpExecutionContext, restored: Artifact, withdrawn: ArtifactRef, why: str) -> None:
    """Materialise ``promoted_policy`` again as ``restored`` (the base model or an earlier checkpoint of the
    chain), withdrawing the promotion of ``withdrawn`` (``assets.promotion``: a policy that got worse)."""
    parent = restored.input_ref("policy")
    iteration = policy_iteration(context.instance, restored)
    context.log_event(dg.AssetMaterialization(
        PROMOTED, description=f"{restored.asset} {restored.data_version} promoted again: {withdrawn.asset} "
                              f"{withdrawn.data_version} withdrawn ({why})",
        metadata={"uri": dg.MetadataValue.path(restored.uri), "data_version": restored.data_version,
                  "artifact_asset": restored.asset, "withdrawn": f"{withdrawn.asset}@{withdrawn.data_version}",
                  CHAIN: chain_of(restored), **({"parent": f"{parent.asset}@{parent.data_version}"} if parent else {}),
                  **({ITERATION: iteration} if iteration is not None else {})},
        tags={DATA_VERSION_TAG: restored.data_version}))


def chain_of(policy: Artifact) -> str:
    return f"base_model@{chain_base(policy)}"


def _position_in(instance: dg.DagsterInstance, asset: str, data_version: str, limit: int = 50) -> dict:
    """``{"iteration": n, "chain_base": ...}`` (what of it is known) that ``asset``'s materialisation of
    ``data_version`` (among its latest ``limit``) carries."""
    for record in instance.fetch_materializations(dg.AssetKey(asset), limit=limit).records:
        metadata = record.asset_materialization.metadata
        recorded = metadata.get("data_version")
        if recorded is not None and recorded.value == data_version and ITERATION in metadata:
            position = {ITERATION: int(metadata[ITERATION].value)}
            if CHAIN in metadata:
                position[CHAIN] = str(metadata[CHAIN].value)
            return position
    return {}


def policy_iteration(instance: dg.DagsterInstance, policy: Artifact) -> int | None:
    """How many RL iterations produced ``policy``: 0 for the base model, else what its promotion recorded (None
    for a checkpoint promoted before iterations were counted)."""
    if policy.asset == "base_model":
        return 0
    return _position_in(instance, PROMOTED, policy.data_version).get(ITERATION)


def input_iteration(instance: dg.DagsterInstance, upstream: Artifact) -> dict:
    """``{"iteration": n, "chain_base": ...}`` of the RL stage whose output ``upstream`` is, {} when not known."""
    return _position_in(instance, upstream.asset, upstream.data_version)


def next_iteration(instance: dg.DagsterInstance, policy: Artifact) -> dict:
    """``{"iteration": n, "chain_base": ...}`` of the iteration that starts from ``policy`` (no iteration when its
    own is not known)."""
    done = policy_iteration(instance, policy)
    return {CHAIN: chain_of(policy), **({} if done is None else {ITERATION: done + 1})}
