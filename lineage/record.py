"""The lineage record an asset publishes with its artifact (``lineage.json``, and the catalog row).

Besides inputs, config and seed it holds what re-running the stage elsewhere needs: the op's run
config as given, the configs of the resources it used (secrets redacted), the run's ``batchrl/`` tags
(e.g. the ``-c`` files of ``batchrl run``) and the environment (packages, git commit, devices). Paths
under the storage root are written relative to it, so a moved or copied root still audits and reproduces.
"""
from __future__ import annotations

from typing import Any

import dagster as dg

from batchrl.common.storage_layout import relative_to_root
from batchrl.lineage.environment import environment_record
from batchrl.lineage.redact import redact
from batchrl.resources import ArtifactRef, StorageResource

NOT_RECORDED = {"storage", "catalog", "io_manager"}  # the root is where the record lives; io is Dagster's
def _resource_configs(context: dg.AssetExecutionContext) -> dict[str, Any]:
    out = {}
    for key in sorted(context.assets_def.required_resource_keys - NOT_RECORDED):
        resource = getattr(context.resources, key, None)
        if hasattr(resource, "model_dump"):
            out[key] = redact(resource.model_dump())
    return out


def lineage_record(context: dg.AssetExecutionContext, storage: StorageResource, *, code_version: str,
                   config: dict, seed: int | None, inputs: dict[str, ArtifactRef],
                   input_files: list[dict]) -> dict[str, Any]:
    root = storage.root_uri()

    def rel(value: Any) -> Any:
        return relative_to_root(value, root)

    return {
        "code_version": code_version,
        "config": rel(config),
        "run_config": rel(context.op_execution_context.op_config or {}),
        "resources": rel(_resource_configs(context)),
        "seed": seed,
        "inputs": {name: {**ref.to_dict(), "uri": rel(ref.uri)} for name, ref in inputs.items()},
        "input_files": rel(input_files),
        "partition": context.partition_key if context.assets_def.partitions_def is not None else None,
        "dagster_run_id": context.run.run_id,
        "run_tags": {k: v for k, v in context.run.tags.items() if k.startswith("batchrl/")},
        "environment": environment_record(),
        "paths": "relative to the storage root",
    }
