"""Run config checked before anything runs: `batchrl run -c run.yaml` fails at once, naming the op and
field, instead of after the earlier assets have spent minutes materialising."""
from __future__ import annotations

import hashlib
import inspect

import dagster as dg
import pydantic

from batchrl.common.dagster_internals import takes_any_config
from batchrl.common.run_config_error import RunConfigError, joined, pydantic_problems, unknown_name_rule
from batchrl.runs.config_messages import dagster_problems
from batchrl.runs.resource_rules import resource_problems


def _library_model(assets_def: dg.AssetsDefinition):
    fn = getattr(assets_def.op.compute_fn, "decorated_fn", None)
    parameter = inspect.signature(fn).parameters.get("config") if fn else None
    annotation = parameter.annotation if parameter else None
    if isinstance(annotation, str):
        annotation = fn.__globals__.get(annotation)
    return getattr(annotation, "library_model", None)


def _where(source: str) -> str:
    return f"run config in {source}" if source else "run config"


def check_op_names(defs: dg.Definitions, run_config: dict, source: str = "") -> None:
    """Every op named in ``run_config`` is an asset's step (a typo would otherwise be dropped silently)."""
    steps = _steps(defs)
    unknown = sorted(set(run_config.get("ops") or {}) - set(steps))
    if not unknown:
        return
    # an asset of a multi-asset step (validated_preferences of log_drop) takes its config under the step's name
    step_of = {key.to_user_string(): op for op, assets_def in steps.items() for key in assets_def.keys
               if key.to_user_string() != op}
    problems = [f"ops.{name}: {name} is an asset of the step {step_of[name]}, its config belongs under "
                f"ops.{step_of[name]}" if name in step_of else
                f"ops.{name}: {unknown_name_rule(name, sorted(steps), 'asset')}" for name in unknown]
    raise RunConfigError(joined(_where(source), problems))


def check_config_taken(defs: dg.Definitions, run_config: dict, source: str = "") -> None:
    """An asset without config (``scored_logs``, ``scored_pairs``) takes no keys. Dagster gives such an op a
    permissive ``Any`` schema, so it would accept any key and the run would ignore it silently."""
    steps = _steps(defs)
    for op, body in (run_config.get("ops") or {}).items():
        given = body.get("config") if isinstance(body, dict) else None
        if not given or op not in steps:  # empty config is no key; an unknown op is check_op_names' to name
            continue
        if takes_any_config(steps[op].op):
            keys = sorted(given) if isinstance(given, dict) else [repr(given)]
            raise RunConfigError(f"{_where(source)}: ops.{op}.config: {op} takes no config, got {', '.join(keys)}")


def _steps(defs: dg.Definitions) -> dict[str, dg.AssetsDefinition]:
    """Op name -> its assets: an asset's own name, or a multi-asset step's (``log_drop``: the per-drop assets)."""
    graph = defs.resolve_asset_graph()
    return {graph.get(key).assets_def.node_def.name: graph.get(key).assets_def for key in graph.get_all_asset_keys()
            if graph.get(key).is_executable}


def op_config_problems(defs: dg.Definitions, job: dg.JobDefinition, run_config: dict) -> list[str]:
    """Every problem of each op's config in ``run_config`` on its own, one line each: Dagster's schema of ``job``
    (unknown keys, types), then each stage's library config (its pydantic validators: ranges such as ``lr > 0``,
    known names, bad combinations within the stage) of every op Dagster's schema did not already refuse."""
    try:
        resolved, problems = dg.validate_run_config(job, run_config), []
    except dg.DagsterInvalidConfigError as error:  # the other ops' values are still checked, as given
        problems = dagster_problems(error, run_config, job)
        refused = {str(item.stack.entries[1].field_name) for item in error.errors if len(item.stack.entries) > 1}
        resolved = {"ops": {op: body for op, body in (run_config.get("ops") or {}).items() if op not in refused}}
    steps = _steps(defs)
    for op, body in (resolved.get("ops") or {}).items():
        model = _library_model(steps[op]) if op in steps else None  # not in steps: an asset check's op
        if model is None or not isinstance(body, dict):
            continue
        try:
            model(**(body.get("config") or {}))
        except pydantic.ValidationError as error:
            problems += pydantic_problems(error, f"ops.{op}.config")
        except (ValueError, TypeError) as error:
            problems.append(f"ops.{op}.config: {error}")
    return problems


def validate_run_config(defs: dg.Definitions, job: dg.JobDefinition, run_config: dict, source: str = "") -> None:
    """Dagster's validation of ``run_config`` against ``job``, then each stage's library config (its
    pydantic validators reject bad combinations), then the whole-run checks of what one stage's choice needs
    from another's among the job's assets. ``RunConfigError``: one line per problem."""
    check_op_names(defs, run_config, source)
    check_config_taken(defs, run_config, source)
    problems = op_config_problems(defs, job, run_config)
    if problems:
        raise RunConfigError(joined(_where(source), problems))
    check_whole_run(defs, run_config, [key.to_user_string() for key in job.asset_layer.executable_asset_keys], source)


def check_whole_run(defs: dg.Definitions, run_config: dict | None, selection: list[str] | None,
                    source: str = "") -> None:
    """What one stage's choice needs from another's among the ``selection`` (None: every asset), and the DPO pair
    source against the code location's graph: ``assets.run_rules.check_run_config``, the one whole-run check (the
    ``rollouts`` asset runs it too, for runs launched from the UI), with the code location's resources (the
    rollout engine the policy update's config must agree with)."""
    from batchrl.assets.run_rules import check_run_config

    try:
        check_run_config(run_config, selection, defs.resolve_asset_graph(), defs.resources)
    except RunConfigError as error:
        raise RunConfigError(f"{_where(source)}: {error}") from None


def validate_plan(defs: dg.Definitions, run_config: dict, executions: list[tuple[dg.JobDefinition, dict]],
                  source: str = "") -> None:
    """One command's run config, whole, before the first asset runs: every op's config in it against the whole
    code location (a typo or a bad value in the config of an asset outside ``--select`` is an error too), the
    resources' config, then each execution's (job, run config), which adds what its selected stages need from
    each other."""
    check_op_names(defs, run_config, source)
    check_config_taken(defs, run_config, source)
    problems = op_config_problems(defs, defs.resolve_implicit_global_asset_job_def(), run_config)
    problems += resource_problems(defs.resources)
    if problems:
        raise RunConfigError(joined(_where(source), problems))
    for job, config in executions:
        validate_run_config(defs, job, config, source)


def config_file_tags(paths: list[str]) -> dict[str, str]:
    """Run tags naming the ``-c`` files and their sha256 (the lineage of every asset echoes them)."""
    if not paths:
        return {}
    digests = []
    for path in paths:
        with open(path, "rb") as f:
            digests.append(f"{path}@sha256:{hashlib.sha256(f.read()).hexdigest()[:16]}")
    return {"batchrl/config_files": ", ".join(digests)}
