"""Dagster's run-config errors as one line each: the key's dotted path (``ops.dpo_checkpoint.config.lr``), the
value given and the rule. Dagster's own message prints the whole expected schema for an unknown key (hundreds of
characters per op) and ``root:ops:...`` paths."""
from __future__ import annotations

from typing import Any

import dagster as dg

from batchrl.common.run_config_error import problem_line, unknown_name_rule


def dagster_problems(error: dg.DagsterInvalidConfigError, run_config: dict, job: dg.JobDefinition) -> list[str]:
    """One line per error of ``dg.validate_run_config(job, run_config)``."""
    return [_problem(item, run_config, job) for item in error.errors]


def _problem(item, run_config: dict, job: dg.JobDefinition) -> str:
    path = [getattr(entry, "field_name", getattr(entry, "list_index", "?")) for entry in item.stack.entries]
    data, reason = item.error_data, getattr(item.reason, "name", str(item.reason))
    if reason in ("FIELD_NOT_DEFINED", "FIELDS_NOT_DEFINED"):
        names = [data.field_name] if hasattr(data, "field_name") else list(data.field_names)
        known = _keys_at(job, path)
        return "; ".join(problem_line(_dotted(path + [name]), unknown_name_rule(name, known),
                                      _value_at(run_config, path + [name])) for name in names)
    if reason == "RUNTIME_TYPE_MISMATCH":
        snap = data.config_type_snap
        expected = f"one of {list(snap.enum_values)}" if snap.enum_values else (snap.given_name or snap.key)
        return problem_line(_dotted(path), f"expected {expected}", _value_at(run_config, path))
    if reason in ("MISSING_REQUIRED_FIELD", "MISSING_REQUIRED_FIELDS"):
        names = [data.field_name] if hasattr(data, "field_name") else list(data.field_names)
        return "; ".join(problem_line(_dotted(path + [name]), "required, not given") for name in names)
    # anything else (a selector's choice, an alias collision): Dagster's sentence, without the schema
    return problem_line(_dotted(path), item.message.split(" Expected:")[0].split(" at path ")[0])


def _dotted(path: list) -> str:
    return ".".join(str(part) for part in path) or "run config"


def _value_at(config: Any, path: list) -> Any:
    for part in path:
        if isinstance(config, dict) and part in config:
            config = config[part]
        elif isinstance(config, list) and isinstance(part, int) and part < len(config):
            config = config[part]
        else:
            return ...
    return config


def _keys_at(job: dg.JobDefinition, path: list) -> list[str]:
    """The keys the job's config schema takes at ``path`` (empty when it cannot tell)."""
    config_type = job.run_config_schema.config_type
    for part in path:
        if isinstance(part, int):  # a list's item: its element type is unwrapped below
            continue
        fields = _fields(config_type)
        if part not in fields:
            return []
        config_type = fields[part].config_type
    return sorted(_fields(config_type))


def _fields(config_type) -> dict:
    """The fields of a shape, through the wrappers around it (``X | None``, a list of X)."""
    while getattr(config_type, "fields", None) is None and getattr(config_type, "inner_type", None) is not None:
        config_type = config_type.inner_type
    fields = getattr(config_type, "fields", None)
    return fields if isinstance(fields, dict) else {}
