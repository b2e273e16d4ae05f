"""The artifact flow between assets (a real Dagster instance, a real S3 API on moto): each asset receives its
upstream artifacts from ``ArtifactIOManager`` as local folders with their lineage and the file names their
producer declared; a partitioned upstream arrives as a mapping partition key -> artifact. And the UI side:
every run-config field the launchpad shows has a description."""

import os

import dagster as dg
import pandas as pd

from batchrl.assets.common import declared_files, output_file, publish
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


def _s3_storage(s3_options, bucket: str, tmp_path):
    """(the bucket's filesystem, a storage rooted in it with its cache under ``tmp_path``)."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    return fs, StorageResource(root=f"s3://{bucket}/root", storage_options=s3_options,
                               cache_dir=str(tmp_path / "cache"))


def test_assets_receive_local_artifacts_with_lineage_from_an_s3_root(s3_options, tmp_path):
    """~5 s."""
    _, storage = _s3_storage(s3_options, "flow-artifacts", tmp_path)
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
    assert os.path.isdir(tmp_path / "cache" / "merged")  # local through the cache (kept there when uploaded)


def test_what_a_host_uploaded_is_its_cached_copy_and_is_not_downloaded_again(s3_options, tmp_path):
    import shutil

    fs, storage = _s3_storage(s3_options, "flow-uploads", tmp_path)

    def publish_rows(run: str):
        with storage.staging_dir("drops") as staging:
            pd.DataFrame({"x": [1, 2]}).to_parquet(os.path.join(staging, "rows.parquet"))
            return storage.publish(staging, "drops", {"run": run})
    ref = publish_rows("first")
    cached = tmp_path / "cache" / "drops" / ref.data_version
    assert sorted(os.listdir(cached)) == ["lineage.json", "rows.parquet"]
    remote = ref.uri.split("://", 1)[1]
    assert fs.cat_file(f"{remote}/lineage.json") == (cached / "lineage.json").read_bytes()
    fs.rm(f"{remote}/rows.parquet")  # gone from the root: only the copy kept at upload can answer now
    assert storage.localize(ref) == str(cached) and len(pd.read_parquet(cached / "rows.parquet")) == 2
    # the same content published again uploads nothing and keeps the first publisher's lineage, also in the cache
    shutil.rmtree(cached)
    assert publish_rows("second") == ref and not cached.exists()
    assert storage.read_lineage(ref)["run"] == "first"


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


def _config_models() -> list[type]:
    """Every config model behind the launchpad: the assets' ``dg.Config`` classes (a run config generated from a
    library model stands for that model), the models nested in them, and the resources' config classes."""
    import importlib
    import pkgutil
    import typing

    import pydantic

    import batchrl.assets
    import batchrl.resources

    bases = (dg.Config, dg.ConfigurableResource, dg.ConfigurableIOManager)
    found: dict[type, None] = {}

    def add(model: type) -> None:
        library = getattr(model, "library_model", None)  # a model, or a function that checks combinations
        model = library if isinstance(library, type) else model
        if model in found or model in bases:
            return
        found[model] = None
        for field in model.model_fields.values():
            for kind in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
                    add(kind)

    for package in (batchrl.assets, batchrl.resources):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, bases):
                    add(value)
    return list(found)


def _launchpad_fields(defs) -> tuple[dict[str, str], int]:
    """``{op.config.path: description}`` of every run-config field of every asset, and of every resource's
    config field (``resources.<key>.<field>``), as Dagster shows them."""
    out: dict[str, str] = {}

    def walk(config_type, path: str) -> None:
        for name, field in (getattr(config_type, "fields", None) or {}).items():
            out[f"{path}.{name}"] = (field.description or "").strip()
            walk(field.config_type, f"{path}.{name}")
        if getattr(config_type, "inner_type", None) is not None:
            walk(config_type.inner_type, path)

    assets = 0
    for assets_def in defs.resolve_asset_graph().assets_defs:
        if assets_def.is_executable and assets_def.op.config_schema is not None:
            assets += 1
            walk(assets_def.op.config_schema.config_type, assets_def.op.name)
    for key, resource in defs.resources.items():
        walk(resource.get_resource_definition().config_schema.config_type, f"resources.{key}")
    return out, assets


def test_every_launchpad_config_field_has_its_own_description():
    """The launchpad shows each run-config field's description, which is written on the field itself
    (``Field(..., description=...)``: TRL's ``help``), not kept in a side table: every field of every asset's
    run config and every resource has one; the two KL coefficients have a name each in the RL recipe
    (``kl_in_reward_coef``, ``kl_loss_coef``), and the old ``kl_coef`` of each stage says where it went."""
    from batchrl.assets.common import field_description
    from batchrl.definitions import build_definitions
    from batchrl.resources.environments import environment_resources

    defs = build_definitions(environment_resources("local"))
    shown, assets = _launchpad_fields(defs)
    assert assets >= 15 and len(shown) > 300
    assert not [path for path, text in shown.items() if not text], "run-config fields without a description"
    assert {f"resources.{k}" for k in ("storage", "catalog", "landing", "rollout_engine", "trainer", "compute")} <= \
        {path.rsplit(".", 1)[0] for path in shown}

    models = _config_models()
    written = {(model, name): field_description(model, name) for model in models for name in model.model_fields}
    assert len(models) >= 20 and not [f"{m.__module__}.{m.__qualname__}.{n}" for (m, n), text in written.items()
                                      if not (text or "").strip()], "fields without description="

    # one text per declaration: the same words on a same-named field of two unrelated models are a copy
    declared: dict[tuple[str, str], set[str]] = {}
    for (model, name), text in written.items():
        origin = next(c for c in reversed(model.__mro__)
                      if (getattr(c, "__pydantic_fields__", None) or {}).get(name) is not None
                      and c.__pydantic_fields__[name].description == text)
        declared.setdefault((name, text), set()).add(f"{origin.__module__}.{origin.__qualname__}")
    copies = {name: sorted(origins) for (name, text), origins in declared.items() if len(origins) > 1}
    assert not copies, f"one description on differently-declared fields: {copies}"
    recipe = "resources.rl_recipe"
    assert "reward" in shown[f"{recipe}.kl_in_reward_coef"] and "loss" in shown[f"{recipe}.kl_loss_coef"]
    assert shown["advantages.kl_coef"].endswith("set resources.rl_recipe.kl_in_reward_coef")
    assert shown["policy_checkpoint.kl_coef"].endswith("set resources.rl_recipe.kl_loss_coef")
