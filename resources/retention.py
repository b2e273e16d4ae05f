"""Artifact retention: the policy (how many checkpoints and carried optimizer states to keep) and the marker an
expired artifact keeps in its folder.

An expired artifact keeps its folder with ``lineage.json`` and batchrl's records beside the data
(``fsutil.RECORD_FILES``: audit and ``batchrl reproduce`` keep working) and gains ``EXPIRED.json``: what was
removed, how many bytes that freed, when and why, one entry per expiry (the carried optimizer state first, the
whole artifact later). Loading an expired artifact fails here, at the boundary, naming it
(``StorageResource.localize``); a re-publication of the same content restores it (``StorageResource.publish``).
What expires and when: ``runs.retention``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field

from batchrl.common import fsutil

MARKER = "EXPIRED.json"
KEPT_FILES = fsutil.RECORD_FILES | {MARKER}  # what an expired folder keeps (top level)
ALL, OPTIMIZER = "all", "optimizer"  # the parts that expire: every data file, or the carried AdamW state alone
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

    @property
    def active(self) -> bool:
        return self.keep_last_checkpoints is not None or self.keep_optimizer_states is not None

    def described(self) -> str:
        parts = [f"{name} {value}" for name, value in self.model_dump().items() if value is not None]
        return ", ".join(parts) or "keep everything"


class ArtifactExpiredError(dg.Failure):
    """An expired artifact was asked for its files (a Dagster failure inside a step, an error elsewhere)."""


def read_marker(fs, folder: str) -> dict[str, Any] | None:
    """``folder``'s ``EXPIRED.json`` (a local folder or a path on ``fs``), None when it has none."""
    try:
        with fs.open(fsutil.join(folder, MARKER), "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def expired_parts(marker: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The parts a marker says expired, each with its (latest) entry: ``{"all": {...}, "optimizer": {...}}``."""
    return {entry["part"]: entry for entry in (marker or {}).get("expiries", [])}


def add_entry(fs, folder: str, asset: str, data_version: str, entry: dict[str, Any]) -> None:
    """Append ``entry`` to ``folder``'s marker, written whole (one rename locally, one PUT on S3): it goes first, so
    a reader never takes a half-deleted folder for a whole one."""
    marker = read_marker(fs, folder) or {"asset": asset, "data_version": data_version, "expiries": []}
    marker["expiries"].append(entry)
    fsutil.atomic_write_bytes(fs, fsutil.join(folder, MARKER), json.dumps(marker, indent=2, sort_keys=True).encode())


def size_text(n: int) -> str:
    """Bytes as retention reports them: GB for checkpoints, MB for small ones (a tiny model's)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _when_why(entry: dict[str, Any]) -> str:
    return f"on {entry.get('expired_at', '?')[:19]} by {entry.get('by', 'batchrl')} ({entry.get('reason', '')}; " \
           f"{size_text(entry.get('bytes_freed', 0))} freed)"


def expired_message(asset: str, data_version: str, entry: dict[str, Any]) -> str:
    return (f"{asset} {data_version} has expired: its data files were deleted {_when_why(entry)}; its lineage.json "
            f"and EXPIRED.json stay (batchrl audit). `batchrl reproduce {asset}/{data_version}` rebuilds it into a "
            "fresh storage root; `batchrl prune --keep` pins a version so it never expires")


def raise_if_expired(fs, folder: str, asset: str, data_version: str) -> None:
    """ArtifactExpiredError naming the artifact, when and why, where ``folder`` holds an expired artifact (one with
    only its optimizer state expired loads: its weights are there)."""
    entry = expired_parts(read_marker(fs, folder)).get(ALL)
    if entry is not None:
        raise ArtifactExpiredError(expired_message(asset, data_version, entry))


def carried_state_problem(checkpoint_dir: str, asset: str, data_version: str) -> str | None:
    """Why an update with ``carry_optimizer_state`` cannot take up the AdamW state of the checkpoint in
    ``checkpoint_dir`` (a local folder): retention removed it. None where it was not (a checkpoint that never had one
    starts a new AdamW, as before)."""
    entry = expired_parts(read_marker(fsutil.filesystem_for(checkpoint_dir)[0], checkpoint_dir)).get(OPTIMIZER)
    if entry is None or os.path.isdir(os.path.join(checkpoint_dir, OPTIMIZER_FOLDER)):
        return None
    return (f"policy_checkpoint: carry_optimizer_state takes up the AdamW state of the policy it trains, {asset} "
            f"{data_version}, but that state has expired: it was deleted {_when_why(entry)}. Train this update "
            "with a new AdamW (carry_optimizer_state: false), or rebuild the checkpoint whole with "
            f"`batchrl reproduce {asset}/{data_version}`. Retention keeps the states of the newest checkpoints "
            "(keep_optimizer_states), of the promoted policy and of the last evaluated one; this one was none of "
            "them when it expired")
