"""The artifact flow between assets (a real Dagster instance, a real S3 API on moto): each asset receives its
upstream artifacts from ``ArtifactIOManager`` as local folders with their lineage and the file names their
producer declared; a partitioned upstream arrives as a mapping partition key -> artifact. And the UI side:
every run-config field the launchpad shows has a description."""

import os

import dagster as dg
import pandas as pd

from batchrl.assets.common import curve_table, declared_files, output_file, publish
from batchrl.resources import Artifact, ArtifactIOManager, CatalogResource, StorageResource

DROPS = dg.StaticPartitionsDefinition(["drop-a", "drop-b"])


@dg.asset(partitions_def=DROPS, metadata=declared_files(table="rows.parquet"))
def drops(context: dg.AssetExecutionContext, storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    with storage.staging_dir("drops") as staging:
        pd.DataFrame({"drop": [context.partition_key] * 3}).to_parquet(output_file(context, staging), index=False)
        return publish(context, storage, catalog, staging, config={"drop": context.partition_key})


@dg.asset(metadata=declared_files(table="merged.parquet"))
def merged(context: dg.AssetExecutionContext, drops: dict, storage: StorageResource,
           catalog: CatalogResource) -> dg.Output:
    assert sorted(drops) == ["drop-a", "drop-b"] and all(isinstance(a, Artifact) for a in drops.values())
    with storage.staging_dir("merged") as staging:
        pd.concat([drops[k].read_table() for k in sorted(drops)]).to_parquet(output_file(context, staging), index=False)
        return publish(context, storage, catalog, staging, inputs={f"drops_{k}": a for k, a in drops.items()})


@dg.asset
def merged_rows(merged: Artifact) -> int:
    assert os.path.isdir(merged.path) and merged.file().startswith(merged.path)  # local, even from s3://
    assert set(merged.lineage["inputs"]) == {"drops_drop-a", "drops_drop-b"}
    assert merged.input_ref("drops_drop-a").asset == "drops" and set(merged.to_dict()) == {"asset", "uri",
                                                                                           "data_version"}
    return len(merged.read_table())


def test_assets_receive_local_artifacts_with_lineage_from_an_s3_root(s3_options, tmp_path):
    """~5 s."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    if not fs.exists("flow-artifacts"):
        fs.mkdir("flow-artifacts")
    storage = StorageResource(root="s3://flow-artifacts/root", storage_options=s3_options,
                              cache_dir=str(tmp_path / "cache"))
    resources = {"storage": storage, "catalog": CatalogResource(path=str(tmp_path / "catalog.duckdb")),
                 "io_manager": ArtifactIOManager(storage=storage)}
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        for key in DROPS.get_partition_keys():
            assert dg.materialize([drops], partition_key=key, instance=instance, resources=resources).success
        result = dg.materialize([drops, merged, merged_rows], selection=[merged, merged_rows], instance=instance,
                                resources=resources)
        assert result.success
        merged_uri = instance.get_latest_materialization_event(dg.AssetKey("merged")).asset_materialization \
            .metadata["uri"].value
    assert merged_uri.startswith("s3://flow-artifacts/root/merged/")
    assert os.path.isdir(tmp_path / "cache" / "merged")  # downloaded once into the cache, then handed over


def test_an_input_never_materialised_fails_naming_it(tmp_path):
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))
    resources = {"storage": storage, "catalog": CatalogResource(path=str(tmp_path / "catalog.duckdb")),
                 "io_manager": ArtifactIOManager(storage=storage)}
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([drops, merged, merged_rows], selection=[merged_rows], instance=instance,
                                resources=resources, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "merged has no materialisation" in str(failure.event_specific_data.error)


def test_every_launchpad_config_field_has_a_description():
    """The launchpad shows a field's description; fields generated from library configs get theirs from the
    library (description or source comment) or from ``assets.config_docs``."""
    from batchrl.definitions import build_definitions

    from batchrl.definitions import environment_resources

    defs = build_definitions(environment_resources("local"))
    ops = defs.resolve_implicit_global_asset_job_def().run_config_schema.config_type.fields["ops"].config_type
    missing, seen = [], 0

    def walk(config_type, path: str) -> None:
        nonlocal seen
        inner = getattr(config_type, "inner_type", None)
        for name, field in (getattr(config_type, "fields", None) or {}).items():
            seen += 1
            if not (field.description or "").strip():
                missing.append(f"{path}.{name}")
            walk(field.config_type, f"{path}.{name}")
        if inner is not None:
            walk(inner, path)

    for op, field in ops.fields.items():
        if "config" in field.config_type.fields:
            walk(field.config_type.fields["config"].config_type, op)
    assert seen > 100 and not missing, missing


def test_curve_table_keeps_the_last_step_and_bounds_rows():
    table = curve_table({"loss_curve": [float(i) for i in range(100)]}, max_rows=10).splitlines()
    assert table[0] == "| step | loss_curve |" and len(table) <= 2 + 11
    assert table[-1] == "| 100 | 99 |" and table[2] == "| 1 | 0 |"
