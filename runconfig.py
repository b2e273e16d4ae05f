"""Run config checked before anything runs: `batchrl run -c run.yaml` fails at once, naming the op and
field, instead of after the earlier assets have spent minutes materialising."""
from __future__ import annotations

import hashlib
import inspect

import dagster as dg
import pydantic


class RunConfigError(ValueError):
    """A run config that Dagster's schema or a stage's library config rejects (the message names both)."""


def _library_model(assets_def: dg.AssetsDefinition):
    fn = getattr(assets_def.op.compute_fn, "decorated_fn", None)
    parameter = inspect.signature(fn).parameters.get("config") if fn else None
    annotation = parameter.annotation if parameter else None
    if isinstance(annotation, str):
        annotation = fn.__globals__.get(annotation)
    return getattr(annotation, "library_model", None)


def check_op_names(defs: dg.Definitions, run_config: dict, source: str = "") -> None:
    """Every op named in ``run_config`` is an asset's step (a typo would otherwise be dropped silently)."""
    known = set(_steps(defs))
    unknown = sorted(set(run_config.get("ops") or {}) - known)
    if unknown:
        where = f" in {source}" if source else ""
        raise RunConfigError(f"run config{where}: no asset named {unknown}; assets: {sorted(known)}")


def _steps(defs: dg.Definitions) -> dict[str, dg.AssetsDefinition]:
    """Op name -> its assets: an asset's own name, or a multi-asset step's (``log_drop``: the per-drop assets)."""
    graph = defs.resolve_asset_graph()
    return {graph.get(key).assets_def.node_def.name: graph.get(key).assets_def for key in graph.get_all_asset_keys()
            if graph.get(key).is_executable}


def validate_run_config(defs: dg.Definitions, job: dg.JobDefinition, run_config: dict, source: str = "") -> dict:
    """Dagster's validation of ``run_config`` against ``job``, then each stage's library config (its
    pydantic validators reject bad combinations). Returns the resolved config (defaults filled)."""
    where = f" in {source}" if source else ""
    check_op_names(defs, run_config, source)
    try:
        resolved = dg.validate_run_config(job, run_config)
    except dg.DagsterInvalidConfigError as error:
        raise RunConfigError(f"run config{where}:\n  " + "\n  ".join(e.message for e in error.errors)) from None
    steps = _steps(defs)
    for op, body in (resolved.get("ops") or {}).items():
        if op not in steps:
            continue  # an asset check's op
        model = _library_model(steps[op])
        if model is None:
            continue
        try:
            model(**(body.get("config") or {}))
        except (pydantic.ValidationError, ValueError, TypeError) as error:
            raise RunConfigError(f"run config{where}: ops.{op}.config: {error}") from None
    return resolved


def config_file_tags(paths: list[str]) -> dict[str, str]:
    """Run tags naming the ``-c`` files and their sha256 (the lineage of every asset echoes them)."""
    if not paths:
        return {}
    digests = []
    for path in paths:
        with open(path, "rb") as f:
            digests.append(f"{path}@sha256:{hashlib.sha256(f.read()).hexdigest()[:16]}")
    return {"batchrl/config_files": ", ".join(digests)}
