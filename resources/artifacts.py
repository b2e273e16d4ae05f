"""The IO manager between assets: each asset receives its upstream artifacts as local folders with their
lineage, never a bare pointer it has to download and parse itself.

Every asset publishes its output under the storage root itself (``assets.common.publish``: content hash,
``lineage.json``, catalog row) and reports ``uri`` and ``data_version`` as materialisation metadata. The
IO manager loads an input from that record: the upstream's latest materialisation (per partition for a
partitioned upstream: a mapping partition key -> artifact), made local (downloaded once into the cache
from an ``s3://`` root; found under the storage root in use, so a copied root with its Dagster home reads
its own copies), with its ``lineage.json`` read and its file names as the producer declared them
(``batchrl/files`` in the producing asset's metadata). One way: artifacts flow down, nothing reads
another asset's files by a name of its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import dagster as dg
from pydantic import Field

from batchrl.resources.storage import ArtifactRef, StorageResource

FILES_KEY = "batchrl/files"  # asset metadata: {role: file name inside the artifact folder}
OPTIONAL_KEY = "batchrl/optional"  # input metadata: None instead of a failure when never materialised


@dataclass(frozen=True)
class Artifact(ArtifactRef):
    """A published artifact made local: ``path`` (a folder), its ``lineage`` (``lineage.json``, input uris
    absolute) and ``files`` (role -> file name, declared once by the producing asset)."""

    path: str = ""
    lineage: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    files: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def to_dict(self) -> dict[str, str]:
        return self.ref.to_dict()

    @property
    def ref(self) -> ArtifactRef:
        return ArtifactRef(self.asset, self.uri, self.data_version)

    def file(self, role: str = "table") -> str:
        """The local path of the file the producer declared for ``role``."""
        if role not in self.files:
            raise KeyError(f"{self.asset} declares no file {role!r} (declared: {sorted(self.files)})")
        return os.path.join(self.path, self.files[role])

    def read_table(self, role: str = "table", **kwargs):
        import pandas as pd

        return pd.read_parquet(self.file(role), **kwargs)

    def input_ref(self, name: str) -> ArtifactRef | None:
        """The artifact this one recorded as its input ``name`` (None when it has none)."""
        entry = self.lineage.get("inputs", {}).get(name)
        return ArtifactRef(entry["asset"], entry["uri"], entry["data_version"]) if entry else None


def make_local(storage: StorageResource, ref: ArtifactRef | dict, files: Mapping[str, str] | None = None) -> Artifact:
    """``ref`` as an :class:`Artifact` under ``storage``'s root: local folder (cached download for S3), lineage
    and declared files."""
    ref = storage.locate(ref)
    return Artifact(ref.asset, ref.uri, ref.data_version, path=storage.localize(ref),
                    lineage=storage.read_lineage(ref), files=dict(files or {}))


def latest_ref(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None = None) -> ArtifactRef | None:
    """The artifact of ``key``'s (``partition``'s) latest materialisation, from its metadata: its ``uri`` as
    recorded there (absolute, where it was published: ``StorageResource.locate`` finds it under the root
    in use now)."""
    if partition is None:
        event = instance.get_latest_materialization_event(key)
        materialization = event.asset_materialization if event else None
    else:
        records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]),
                                                  limit=1).records
        materialization = records[0].asset_materialization if records else None
    if materialization is None or "uri" not in materialization.metadata:
        return None
    meta = materialization.metadata
    asset = meta["artifact_asset"].value if "artifact_asset" in meta else key.to_user_string()  # a promotion
    return ArtifactRef(asset, meta["uri"].value, meta["data_version"].value)


def load_artifacts(context: dg.InputContext, storage: StorageResource,
                   ref_for: Callable[[str | None], ArtifactRef | None]) -> Artifact | dict[str, Artifact] | None:
    """An input as :class:`Artifact` (a mapping partition key -> artifact for a partitioned upstream), the
    refs from ``ref_for(partition)``; an input marked optional is None when its upstream has none."""
    upstream = context.upstream_output
    files = (upstream.definition_metadata or {}).get(FILES_KEY, {}) if upstream is not None else {}

    metadata = context.definition_metadata or {}

    def one(partition: str | None) -> Artifact | None:
        ref = ref_for(partition)
        if ref is None:
            if metadata.get(OPTIONAL_KEY) or (partition is not None and metadata.get("allow_missing_partitions")):
                return None
            where = f" partition {partition}" if partition else ""
            raise dg.Failure(f"{context.asset_key.to_user_string()}{where} has no materialisation: materialise it "
                             "first (it is an input of this step)")
        return make_local(storage, ref, files)

    if context.has_asset_partitions:  # a window of an upstream's partitions (allow_missing_partitions: those there are)
        loaded = {key: one(key) for key in context.asset_partition_keys}
        return {key: artifact for key, artifact in loaded.items() if artifact is not None}
    return one(None)


class ArtifactIOManager(dg.ConfigurableIOManager):
    """Hands each asset its upstream artifacts as :class:`Artifact` (see the module docstring)."""

    storage: StorageResource = Field(description="the storage whose root holds the artifacts handed to the "
                                     "assets (remote ones come through its cache_dir)")

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        """Nothing to store: the asset published its artifact (immutable, content-addressed) already."""

    def load_input(self, context: dg.InputContext) -> Artifact | dict[str, Artifact] | None:
        return load_artifacts(context, self.storage, lambda partition: latest_ref(context.instance, context.asset_key,
                                                                                  partition))
