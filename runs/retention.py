"""What a retention policy (``resources.retention.RetentionPolicy``) expires, and what it never does.

Every RL iteration publishes a checkpoint (with ``carry_optimizer_state`` also AdamW's moments, 8 bytes per
parameter) and nothing expired: a 0.5B run filled a 64 GiB disk in 7 iterations. The plan, from the catalog (every
version of every trained asset, newest materialisation first) and the Dagster instance (the latest ones):

- ``keep_last_checkpoints`` N: per trained asset, the versions older than the N newest expire whole;
- ``keep_optimizer_states`` K: per asset, the carried optimizer state of checkpoints older than the K newest that
  have one expires (``optimizer/`` alone; the weights stay);
- ``keep_every`` M: the asset's M-th, 2M-th, ... version (catalog order of first publication) is kept whole.

Never expired: each asset's latest materialisation (what the IO manager hands the next step; for a companion such
as ``critic_checkpoint``, which Dagster does not materialise, its newest version in the catalog), the checkpoint
``promoted_policy`` points to, pinned versions (``--keep``), and, whole (their optimizer state may go), the trained
artifacts a latest artifact of another stage reads through its lineage (the policy the latest rollouts sampled
from, which off-policy sampling and a critic's advantages read again; the critic the latest advantages used; the
policy the latest evaluation scored, which the promotion gate may promote again: its optimizer state stays too)
and the companions of anything kept. A checkpoint's parent is an input of the next one too, but nothing reads it
to run: lineage keeps the edge, its files may go. How an expiry frees the space: ``runs.expire``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

from batchrl.common.expired import ALL, OPTIMIZER
from batchrl.resources.retention import OPTIMIZER_FOLDER, WORK_DIR_KEY, RetentionPolicy
from batchrl.resources.storage import ArtifactRef

# the assets a trainer job publishes (assets.common.train_and_publish; critic_checkpoint beside the policy): the
# ones retention expires. The base model (the chain's root and KL reference) and the data stages are never expired.
RETAINED_ASSETS = ("policy_checkpoint", "critic_checkpoint", "reward_model", "dpo_checkpoint",
                   "offline_policy_checkpoint", "kto_checkpoint")
PROMOTED = "promoted_policy"  # assets.policy_chain.PROMOTED (runs may import assets; this stays light)
# the promotion gate may promote again the policy the latest evaluation scored (assets.promotion): the next update
# then trains it, carrying its optimizer state, so that state is kept too
GATED = "evaluation"
STATE_METRIC = "optimizer_state_step"  # what an update that carries its AdamW state reports (training.trainer.policy)


@dataclass
class Version:
    """One version of a trained asset as the catalog knows it."""

    asset: str
    data_version: str
    uri: str
    last: datetime  # its latest materialisation
    metadata: dict[str, Any]  # that materialisation's
    expired: set[str] = field(default_factory=set)  # the parts whose expiry still holds (none restored them since)

    @property
    def key(self) -> tuple[str, str]:
        return self.asset, self.data_version

    @property
    def ref(self) -> ArtifactRef:
        return ArtifactRef(self.asset, self.uri, self.data_version)


@dataclass(frozen=True)
class Expiry:
    """One planned expiry: ``part`` (``all`` or ``optimizer``) of a version, and why."""

    version: Version
    part: str
    reason: str

    @property
    def work_dir(self) -> str | None:
        """The trainer work dir its files are linked from (relative to the cache dir); None when not recorded."""
        return self.version.metadata.get(WORK_DIR_KEY)


@dataclass
class Plan:
    expiries: list[Expiry]
    kept: dict[tuple[str, str], str]  # versions the numbers would expire (whole or their state) that stay, and why


def catalog_versions(catalog, storage) -> dict[tuple[str, str], Version]:
    """Every version of the trained assets in the catalog, its uri under ``storage``'s root, with the expiries that
    still hold (recorded after its latest materialisation: a re-publication restores an expired version)."""
    marks = ", ".join("?" * len(RETAINED_ASSETS))
    rows = catalog.query(f"SELECT asset, data_version, uri, created_at, metadata FROM artifacts WHERE asset IN "
                         f"({marks}) ORDER BY created_at", list(RETAINED_ASSETS))
    versions: dict[tuple[str, str], Version] = {}
    for asset, data_version, uri, created_at, metadata in rows:  # oldest first: the newest row wins
        versions[(asset, data_version)] = Version(asset, data_version, storage.locate(ArtifactRef(
            asset, uri, data_version)).uri, created_at, json.loads(metadata) if metadata else {})
    for asset, data_version, part, expired_at in catalog.query(
            "SELECT asset, data_version, part, max(expired_at) FROM artifact_expiries GROUP BY ALL"):
        version = versions.get((asset, data_version))
        if version is not None and expired_at >= version.last:
            version.expired.add(part)
    return versions


def _lineage_inputs(catalog, asset: str, data_version: str) -> dict[str, dict]:
    rows = catalog.query("SELECT lineage FROM artifacts WHERE asset = ? AND data_version = ? AND lineage IS NOT NULL "
                         "ORDER BY created_at DESC LIMIT 1", [asset, data_version])
    return json.loads(rows[0][0]).get("inputs", {}) if rows else {}


def protected(catalog, instance, versions: dict[tuple[str, str], Version],
              pins: Iterable[str]) -> tuple[dict[tuple[str, str], str], dict[tuple[str, str], str]]:
    """``(whole, state)``: the versions never expired whole, and those whose optimizer state never expires, each
    with why (the module docstring's rules)."""
    import dagster as dg

    from batchrl.resources.artifacts import latest_ref

    whole: dict[tuple[str, str], str] = {}
    state: dict[tuple[str, str], str] = {}

    def keep(key: tuple[str, str], why: str, with_state: bool = True) -> None:
        whole.setdefault(key, why)
        if with_state:
            state.setdefault(key, why)

    names = [row[0] for row in catalog.query("SELECT DISTINCT asset FROM artifacts ORDER BY asset")]
    for name in [PROMOTED, *names]:
        ref = latest_ref(instance, dg.AssetKey(name)) if instance is not None else None
        if ref is None:
            continue
        keep((ref.asset, ref.data_version), "the promoted policy" if name == PROMOTED else "the latest materialisation")
        if name not in RETAINED_ASSETS and name != PROMOTED:  # a stage that reads trained artifacts by its lineage
            for input_name, entry in sorted(_lineage_inputs(catalog, name, ref.data_version).items()):
                if entry.get("asset") in RETAINED_ASSETS:
                    keep((entry["asset"], entry["data_version"]), f"read by the latest {name} {ref.data_version} "
                         f"(its input {input_name})", with_state=name == GATED)
    newest: dict[str, Version] = {}
    for version in versions.values():
        if version.asset not in newest or version.last > newest[version.asset].last:
            newest[version.asset] = version
    for version in newest.values():  # a companion (no Dagster materialisation) or a catalog without an instance
        keep(version.key, "the newest version in the catalog")
    for pin in pins:
        for key in versions:
            if key[1] == pin:
                keep(key, "pinned (--keep)")
    for key, why in list(whole.items()):  # a kept checkpoint's companions (its critic) stay with it
        metadata = versions[key].metadata if key in versions else {}
        for companion in RETAINED_ASSETS:
            if metadata.get(f"{companion}_data_version"):  # what train_and_publish records of each companion
                keep((companion, metadata[f"{companion}_data_version"]), f"companion of {key[0]} {key[1]}",
                     with_state=key in state)
    return whole, state


def unknown_pins(versions: dict[tuple[str, str], Version], pins: Iterable[str]) -> list[str]:
    """The pinned data versions no trained artifact has (a typo must not let the version meant expire)."""
    known = {data_version for _, data_version in versions}
    return [pin for pin in pins if pin not in known]


def has_optimizer_state(storage, version: Version) -> bool:
    """Whether the version still holds a carried optimizer state: reported by its update, and its folder there."""
    if version.metadata.get(STATE_METRIC) is None or OPTIMIZER in version.expired:
        return False
    fs, path = storage.artifact_location(version.ref)
    return fs.isdir(f"{path.rstrip('/')}/{OPTIMIZER_FOLDER}")


def _ordinals(versions: dict[tuple[str, str], Version]) -> dict[tuple[str, str], int]:
    """Each version's place (1-based) among its asset's versions in order of first publication (``versions`` keeps
    the catalog's order); the same content published again keeps its first place."""
    counts: dict[str, int] = {}
    places = {}
    for key in versions:
        counts[key[0]] = places[key] = counts.get(key[0], 0) + 1
    return places


def plan(storage, catalog, instance, policy: RetentionPolicy, pins: Iterable[str] = ()) -> Plan:
    """The expiries ``policy`` asks for now (see the module docstring); ValueError for a pin that names no
    version."""
    pins = list(pins)
    versions = catalog_versions(catalog, storage)
    missing = unknown_pins(versions, pins)
    if missing:
        raise ValueError(f"--keep {' '.join(missing)}: no trained artifact has this data version "
                         f"({', '.join(RETAINED_ASSETS)}); nothing was expired")
    whole, state = protected(catalog, instance, versions, pins)
    by_asset: dict[str, list[Version]] = {}
    for version in sorted(versions.values(), key=lambda v: v.last, reverse=True):
        if ALL not in version.expired:
            by_asset.setdefault(version.asset, []).append(version)
    expiries, kept = [], {}
    ordinal = _ordinals(versions)
    for asset, live in sorted(by_asset.items()):
        n, k, m = policy.keep_last_checkpoints, policy.keep_optimizer_states, policy.keep_every
        for version in live[n:] if n is not None else []:
            if version.key in whole:
                kept[version.key] = whole[version.key]
            elif m and ordinal[version.key] % m == 0:
                kept[version.key] = f"keep_every {m}: {asset}'s version no. {ordinal[version.key]}"
            else:
                expiries.append(Expiry(version, ALL, f"keep_last_checkpoints {n}: older than the {n} newest "
                                                     f"{asset} versions"))
        gone = {e.version.key for e in expiries}
        with_state = [v for v in live if v.key not in gone and has_optimizer_state(storage, v)] if k else []
        for version in with_state[k:]:
            if version.key in state:
                kept[version.key] = state[version.key]
            else:
                expiries.append(Expiry(version, OPTIMIZER, f"keep_optimizer_states {k}: older than the {k} newest "
                                                           f"{asset} optimizer states"))
    return Plan(expiries, kept)
