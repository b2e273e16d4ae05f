"""Artifact retention: the policy (how many checkpoints and carried optimizer states to keep), and the boundaries
an expired artifact meets here: loading one fails naming it (``StorageResource.localize``), and so does an update
that would carry an expired optimizer state. The marker an expired artifact keeps: ``common.expired``; what
expires and when: ``runs.retention``; how the space is freed: ``runs.expire``.
"""
from __future__ import annotations

import os

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field

from batchrl.common import fsutil
from batchrl.common.expired import MARKER, OPTIMIZER, expired_parts, expired_refusal, read_marker, when_why

KEPT_FILES = fsutil.RECORD_FILES | {MARKER}  # what an expired folder keeps (top level)
OPTIMIZER_FOLDER = "optimizer"  # training.trainer.optimizer_state.FOLDER (torch-free here)
# catalog metadata of a trained artifact: the trainer work dir (relative to the storage's cache_dir) whose export it
# is; its files are hard links of the published ones, so an expiry frees the space only when that folder goes too
WORK_DIR_KEY = "work_dir"


class RetentionPolicy(BaseModel):
    """How many trained artifacts to keep (verl's ``max_ckpt_to_keep``, TRL's ``save_total_limit``); None keeps all.
    Never expired whatever the numbers: each asset's latest materialisation, the promoted policy, pinned versions,
    and trained artifacts that a latest artifact reads through its lineage (``runs.retention``)."""

    model_config = ConfigDict(extra="forbid")

    keep_last_checkpoints: int | None = Field(
        None, ge=1, description="per trained asset (policy_checkpoint, critic_checkpoint, reward_model, "
        "dpo_checkpoint, ...), the N newest versions keep their files; older ones expire: their data files and "
        "trainer work dir are deleted, lineage.json and an EXPIRED.json marker stay. None: keep all")
    keep_optimizer_states: int | None = Field(
        None, ge=1, description="the carried AdamW moments (carry_optimizer_state: optimizer/ in a checkpoint, "
        "8 bytes per trainable parameter) stay on the N newest checkpoints that have them; older ones lose that "
        "folder alone (the weights stay). None: keep all")
    keep_every: int | None = Field(
        None, ge=1, description="besides the newest, keep every N-th version of each trained asset whole (its N-th, "
        "2N-th, ... in the catalog: in an RL chain, the policies after iterations N, 2N, ...), for accuracy-over-"
        "training curves and rollback points (Orbax's keep_period); keep_optimizer_states still applies to them. "
        "None: no such points")

    @property
    def active(self) -> bool:
        return self.keep_last_checkpoints is not None or self.keep_optimizer_states is not None


class ArtifactExpiredError(dg.Failure):
    """An expired artifact was asked for its files (a Dagster failure inside a step, an error elsewhere)."""


def raise_if_expired(fs, folder: str) -> None:
    """ArtifactExpiredError naming the artifact, when and why, where ``folder`` holds an expired artifact."""
    refusal = expired_refusal(fs, folder)
    if refusal is not None:
        raise ArtifactExpiredError(refusal)


def carried_state_problem(checkpoint_dir: str, asset: str, data_version: str) -> str | None:
    """Why an update with ``carry_optimizer_state`` cannot take up the AdamW state of the checkpoint in
    ``checkpoint_dir`` (a local folder): retention removed it. None where it was not (a checkpoint that never had one
    starts a new AdamW, as before)."""
    entry = expired_parts(read_marker(fsutil.filesystem_for(checkpoint_dir)[0], checkpoint_dir)).get(OPTIMIZER)
    if entry is None or os.path.isdir(os.path.join(checkpoint_dir, OPTIMIZER_FOLDER)):
        return None
    return (f"policy_checkpoint: carry_optimizer_state takes up the AdamW state of the policy it trains, {asset} "
            f"{data_version}, but that state has expired: it was deleted {when_why(entry)}. Train this update "
            "with a new AdamW (carry_optimizer_state: false), or rebuild the checkpoint whole with "
            f"`batchrl reproduce {asset}/{data_version}`. Retention keeps the states of the newest checkpoints "
            "(keep_optimizer_states), of the promoted policy and of the last evaluated one; this one was none of "
            "them when it expired")
