"""What every asset does the same way: code versions, publishing, lineage, catalog rows."""
from __future__ import annotations

import hashlib
import json
import os
import time
import types
import warnings
import typing
from typing import Any

import dagster as dg
import pydantic

from batchrl.assets.background_curves import BackgroundCurves
from batchrl.assets.curves import read_steps, step_series
from batchrl.common import fsutil
from batchrl.common.plot_keys import numbers_as_text_when_not_plotted, plotted
from batchrl.lineage.code_versions import code_version  # noqa: F401  (the assets import it from here)
from batchrl.lineage.record import lineage_record
from batchrl.lineage.redact import redact
from batchrl.resources import ArtifactRef, CatalogResource, StorageResource, TrackingResource, TrainerLauncherResource
from batchrl.resources.artifacts import FILES_KEY, Artifact
from batchrl.resources.retention import WORK_DIR_KEY


def as_ref(value: ArtifactRef | dict) -> ArtifactRef:
    if isinstance(value, Artifact):
        return value.ref
    return value if isinstance(value, ArtifactRef) else ArtifactRef(**value)


def declared_files(**roles: str) -> dict[str, dict[str, str]]:
    """Asset metadata naming the files of the artifact it publishes (``role=file name``), once: the asset
    writes them through :func:`output_file`, and consumers open them as ``artifact.file(role)``."""
    return {FILES_KEY: roles}


def output_file(context: dg.AssetExecutionContext, staging: str, role: str = "table") -> str:
    """Where in ``staging`` this asset writes the file it declared for ``role``."""
    return os.path.join(staging, context.assets_def.metadata_by_key[context.asset_key][FILES_KEY][role])


def publish(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    catalog: CatalogResource,
    staging: str,
    *,
    inputs: dict[str, ArtifactRef | dict] | None = None,
    config: dict[str, Any] | None = None,
    seed: int | None = None,
    input_files: list[dict[str, Any]] | None = None,
    metadata: dict[str, Any] | None = None,
    sidecars: dict[str, dict] | None = None,
    asset: str | None = None,
    content_hash: str | None = None,
) -> dg.Output:
    """Publish ``staging`` as this asset's new immutable version and return the Dagster output.
    ``asset`` names a companion artifact published by the same step (default: the asset itself);
    ``content_hash``: the files' hash when their writer took it (``StorageResource.publish``)."""
    started = time.perf_counter()
    by_key = context.assets_def.code_versions_by_key
    single = len(context.assets_def.keys) == 1  # a multi-asset step names each of its assets
    asset = asset or context.asset_key.to_user_string()
    code = by_key.get(dg.AssetKey(asset)) or (by_key.get(context.asset_key) if single else "") or ""
    lineage = redact(lineage_record(context, storage, code_version=code, config=config or {}, seed=seed,
                                    inputs={name: as_ref(ref) for name, ref in (inputs or {}).items()},
                                    input_files=input_files or []))
    ref = storage.publish(staging, asset, lineage, sidecars, content_hash)
    metadata = redact(dict(metadata or {}))
    plain = {k: v for k, v in metadata.items() if not isinstance(v, dg.MetadataValue)}  # tables/markdown: UI only
    catalog.record(asset=asset, data_version=ref.data_version, uri=ref.uri, run_id=context.run.run_id,
                   code_version=code, metadata=plain, lineage=lineage, root=storage.root_uri())
    # lineage, hash (unless the writer took it), publish, catalog: the step's own seconds after its work
    metadata.update(uri=dg.MetadataValue.path(ref.uri), data_version=ref.data_version,
                    publish_s=round(time.perf_counter() - started, 3))
    if seed is not None:
        metadata["seed"] = seed
    metadata = numbers_as_text_when_not_plotted(metadata)  # seed, world size...: text, not a plot each
    with warnings.catch_warnings():  # Output(data_version=...) is flagged beta; it is the documented way
        warnings.simplefilter("ignore", dg.BetaWarning)
        return dg.Output(ref.to_dict(), data_version=dg.DataVersion(ref.data_version), metadata=metadata,
                         output_name="result" if single else asset)


def _dagster_type(annotation: Any) -> Any:
    """Dagster config takes string Literals (as enums) but not int Literals: widen those to int.
    The library config re-validates the allowed values when the run builds it."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal and not all(isinstance(a, str) for a in args):
        return type(args[0])
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return run_config_for(annotation, f"{annotation.__name__}RunConfig")
    if typing.get_origin(annotation) is dict and typing.get_origin(args[0]) in (typing.Union, types.UnionType):
        return typing.Any  # keys of several types (YAML's {1: false, "5": true}): a Dagster map takes one key type
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        widened = tuple(_dagster_type(a) for a in args)
        return typing.Optional[widened[0]] if len(widened) == 2 and type(None) in widened else annotation
    return annotation


def field_description(model_cls: type[pydantic.BaseModel], name: str) -> str | None:
    """The description written on the field (``Field(..., description=...)``); for a subclass that redeclares
    a field only to change its default or bounds, the nearest base class's."""
    for cls in model_cls.__mro__:
        field = (getattr(cls, "__pydantic_fields__", None) or {}).get(name)
        if field is not None and field.description:
            return field.description
    return None


def run_config_for(model_cls: type[pydantic.BaseModel], name: str) -> type[dg.Config]:
    """A Dagster run-config class with the library config's fields, defaults and descriptions (the launchpad
    shows them: each field's own, :func:`field_description`), so no field is listed twice."""
    fields = {key: (_dagster_type(field.annotation),
                    pydantic.Field(field.get_default(call_default_factory=True),
                                   description=field_description(model_cls, key)))
              for key, field in model_cls.model_fields.items()}
    run_config = pydantic.create_model(name, __base__=dg.Config, **fields)
    run_config.library_model = model_cls  # `batchrl run` validates -c files with it before anything runs
    return run_config


def to_library_config(config: dg.Config, model_cls: type):
    return model_cls(**config.model_dump())


def work_dir(storage: StorageResource, asset: str, key: dict) -> str:
    """A stable per-(inputs, config) folder for trainer checkpoints, so a re-run resumes exactly."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = os.path.abspath(os.path.join(storage.cache_dir, "_work", fsutil.safe_name(asset, "asset name"), digest))
    os.makedirs(path, exist_ok=True)
    return path


TRAIN_RECORD = "batchrl_train.json"  # what training.trainer.checkpoint writes beside an export (torch-free here)


def train_and_publish(context, job: str, job_config: dict, inputs: dict, seed: int, storage: StorageResource,
                      catalog: CatalogResource, launcher: TrainerLauncherResource,
                      companions: dict[str, tuple[str, dict]] | None = None,
                      metadata: dict[str, Any] | None = None, tracking: TrackingResource | None = None,
                      job_extras: dict[str, Any] | None = None) -> dg.Output:
    """Run a trainer job through Pipes in a resumable work dir and publish its exported HF model.

    ``companions``: ``{artifact: (work-dir subfolder, lineage inputs)}``, other models the job
    exported (e.g. the critic), each published as its own versioned artifact with its own lineage;
    the main artifact names them in ``companions.json`` and in ``<artifact>_data_version`` metadata;
    ``metadata``: the asset's own numbers beside the job's; ``tracking``: where the run is also logged (MLflow);
    ``job_extras``: more for the job that is neither its work dir's key nor its lineage (how it runs, not what)."""
    workdir = work_dir(storage, context.asset_key.to_user_string(),
                       {"inputs": {k: as_ref(v).data_version for k, v in inputs.items()}, "config": job_config})
    job_config = {**job_config, "out_dir": workdir}
    started = time.perf_counter()
    with BackgroundCurves(workdir) as curves:  # the chart drawn as the steps come, not after the job
        result = launcher.run_job(context, job, {**job_config, **(job_extras or {})}, workdir)
    metrics = {k: v.value if hasattr(v, "value") else v for k, v in (result.metadata or {}).items()}
    metrics["job_wall_s"] = time.perf_counter() - started  # subprocess start, model loads and training
    lists = {k: v for k, v in metrics.items() if isinstance(v, list) and v and k != "loss_curve"}
    series = step_series(read_steps(workdir), lists) or step_series([], {"loss": metrics.get("loss_curve") or []})
    ui = curves.metadata(series)  # the per-step curves: a chart and a table
    config = {k: v for k, v in job_config.items() if k != "out_dir"}  # the job's config, as the lineage records it
    published = {}
    # the work dir each artifact's files are linked from, for retention (runs/retention.py) to free with it
    work = os.path.relpath(workdir, os.path.abspath(storage.cache_dir))
    for name, (subdir, companion_inputs) in (companions or {}).items():
        with storage.staging_dir(name) as staging:
            fsutil.link_tree(os.path.join(workdir, subdir), staging)
            ref = publish(context, storage, catalog, staging, asset=name, seed=seed, inputs=companion_inputs,
                          config=config, metadata={WORK_DIR_KEY: os.path.join(work, subdir)}).value
        published[name] = ref
        metrics.update({f"{name}_uri": ref["uri"], f"{name}_data_version": ref["data_version"]})
    with storage.staging_dir(context.asset_key.to_user_string()) as staging:
        # the job's export (write-once, gigabytes) as links: then the job's hash of it is the data version
        linked = fsutil.link_tree(os.path.join(workdir, "model"), staging)
        sidecars = {"train_metrics.json": metrics}
        if published:
            sidecars["companions.json"] = published
        record = os.path.join(workdir, TRAIN_RECORD)
        if os.path.exists(record):  # holds wall-clock times: kept beside the weights, out of their version
            with open(record) as f:
                sidecars[TRAIN_RECORD] = json.load(f)
        output = publish(context, storage, catalog, staging, seed=seed, inputs=inputs, config=config,
                         metadata={**metrics, **(metadata or {}), **ui, WORK_DIR_KEY: work}, sidecars=sidecars,
                         content_hash=metrics.get("content_hash") if linked else None)
    if tracking is not None and tracking.enabled:
        numbers = {**metrics, **(metadata or {})}
        tracking.log_training(
            context, asset=context.asset_key.to_user_string(), series=series, uri=output.value["uri"],
            data_version=output.value["data_version"],
            params={**config, "seed": seed, "inputs": {k: as_ref(v).data_version for k, v in inputs.items()}},
            # final/*: the series' last points, logged already
            summary={k: v for k, v in numbers.items() if plotted(k) and not k.startswith("final/")})
    return output
