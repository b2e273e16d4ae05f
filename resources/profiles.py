"""Run profiles: named bundles of resource overrides and run config (``profiles/<name>.yaml``), and the
``batchrl run -c`` files, which take the same ``resources`` and ``ops`` and are merged over the profile.

A profile's top level is its CPU (smoke-size) form; ``environments.<BATCHRL_ENV>`` is merged over it
(e.g. bigger batches for ``gpu``). ``resources`` override fields of the environment's resources
(``{sample_data}`` in a string is the shipped sample-data folder), ``ops`` is Dagster run config,
``rl_iterations`` the default number of on-policy iterations of ``batchrl run``.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import pydantic
import yaml

from batchrl.common.environment_variables import read
from batchrl.common.package import PACKAGE_DIR
from batchrl.common.run_config_error import (
    RunConfigError, joined, problem_line, pydantic_problems, unknown_name_rule,
)

PROFILE_DIR = os.path.join(PACKAGE_DIR, "profiles")
SAMPLE_DATA = os.path.join(PACKAGE_DIR, "sample_data")


class ProfileError(RunConfigError):
    """An unknown profile, a malformed profile or ``-c`` file, or resource overrides the resources do not take
    (the message names the file, and each field on a line of its own)."""


# + extends: a parent profile; retention: resources.retention.RetentionPolicy's fields (`batchrl run` prunes with it)
PROFILE_KEYS = {"description", "rl_iterations", "resources", "ops", "environments", "retention"}
RUN_FILE_KEYS = {"resources", "ops", "environments", "retention"}  # a ``-c`` file: what a profile overrides
# `batchrl run -c` files' resource overrides, for the code location the command (and its step processes) builds:
# JSON [[file, {resource: {field: value}}], ...], in the order given
CONFIG_RESOURCES_ENV = "BATCHRL_CONFIG_RESOURCES"


#: what `batchrl run` without a profile adds to the run config, under its ``-c`` files, when the base model is the
#: embedded tiny default (README command 1): the warm start teaches the sums with a habit RL can unlearn (each draw
#: the gold answer 30% of the time, gold + 1 otherwise; training/models/warm_start.py), and the RL update unlearns it
#: in one iteration (a smaller lr than the library default, which collapses it). Run config only, no resource: a
#: resource override would make the run's job differ from the one the UI loads (its re-execution would then be "a
#: different version"). Measured in bench/RESULTS.md (issue 50).
EMBEDDED_DEFAULT = {
    "base_model": {"config": {"warm_start_steps": 400, "warm_start_lr": 1.0e-3, "warm_start_lr_schedule": "cosine",
                              "warm_start_gold_share": 0.3, "warm_start_near_miss_offset": 1}},
    "policy_checkpoint": {"config": {"lr": 2.0e-4}},
}
BASE_MODEL_SOURCES = ("model_path", "gguf_file", "gguf_parts")  # any of them set: not the tiny default


def embedded_default(ops: dict) -> dict:
    """``EMBEDDED_DEFAULT``'s ops for a run without a profile whose ``-c`` files' merged ``ops`` are these; nothing
    when they name a base model of their own (a path, a GGUF)."""
    base = ((ops or {}).get("base_model") or {}).get("config") or {}
    return {} if any(base.get(name) for name in BASE_MODEL_SOURCES) else EMBEDDED_DEFAULT


def available_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base``; nested dicts merge, everything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _expand(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("{sample_data}", SAMPLE_DATA)
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    return value


class _FloatAwareSafeLoader(yaml.SafeLoader):
    """YAML 1.1's SafeLoader reads ``1e-5`` (no dot) as a string, so ``lr: 1e-5`` failed the config check as
    "expected Float" (and so did JSON's ``1e-05``); config files here read it as the float YAML 1.2 and JSON mean."""


_FloatAwareSafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_FloatAwareSafeLoader) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ProfileError(f"{path}: {' '.join(str(error).split())}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: a mapping of keys expected at the top level, got {type(raw).__name__}")
    return raw


def _for_env(raw: dict, path: str, allowed: set[str], env: str | None) -> dict:
    """The file's top level with ``environments.<env>`` merged over it (keys outside ``allowed`` refused)."""
    unknown = set(raw) - allowed
    if unknown:
        raise ProfileError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    env = env or read("BATCHRL_ENV")
    return deep_merge({k: v for k, v in raw.items() if k != "environments"}, (raw.get("environments") or {}).get(env) or {})


def load_profile(name: str, env: str | None = None) -> dict[str, Any]:
    """``{"resources": {...}, "ops": {...}, "rl_iterations": int, "description": str, "retention": {...}}`` of a
    profile."""
    path = _profile_path(name)
    merged = _for_env(_profile_raw(path), path, PROFILE_KEYS, env)
    return {"description": merged.get("description", ""), "rl_iterations": int(merged.get("rl_iterations", 1)),
            "resources": _plain_resources(_expand(merged.get("resources") or {})),
            "ops": _expand(merged.get("ops") or {}), "retention": _retention(merged.get("retention"), path)}


def _retention(block: Any, path: str) -> dict:
    """A profile's or ``-c`` file's ``retention:`` as written (its fields merge over an earlier file's), checked
    against ``RetentionPolicy``: ProfileError with a line per problem."""
    from batchrl.resources.retention import RetentionPolicy

    if block is None:
        return {}
    if not isinstance(block, dict):
        raise ProfileError(problem_line(f"{path}: retention", "a mapping of RetentionPolicy fields expected", block))
    try:
        RetentionPolicy(**block)
    except pydantic.ValidationError as error:
        raise ProfileError(joined(path, pydantic_problems(error, "retention"))) from None
    return dict(block)


def _profile_path(name: str) -> str:
    path = name if name.endswith(".yaml") else os.path.join(PROFILE_DIR, f"{name}.yaml")
    if not os.path.exists(path):
        raise ProfileError(f"unknown profile {name!r}: no {path}; known: {available_profiles()}")
    return path


def _profile_raw(path: str, chain: tuple[str, ...] = ()) -> dict:
    """The profile file with the profile it ``extends`` (a name, or a path relative to this file) under it: its keys
    merged over the parent's, nested mappings key by key (a variant states only what differs: another model, LoRA)."""
    raw = _read_yaml(path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ProfileError(f"{path}: extends must name one profile, got {parent!r}")
    parent_path = _profile_path(parent if not parent.endswith(".yaml") else
                                os.path.join(os.path.dirname(os.path.abspath(path)), parent))
    if os.path.abspath(parent_path) in chain:
        raise ProfileError(f"{path}: extends {parent!r} makes a cycle ({' -> '.join((*chain, parent_path))})")
    return deep_merge(_profile_raw(parent_path, (*chain, os.path.abspath(path))), raw)


def load_run_file(path: str, env: str | None = None) -> dict[str, Any]:
    """``{"ops": {...}, "resources": {...}, "retention": {...}}`` of a ``batchrl run -c`` file: as in a profile (and
    ``environments.<BATCHRL_ENV>`` merged over them); a file of none of these keys is a mapping of ops, as
    ``dagster asset materialize -c`` takes after ``ops:``."""
    raw = _read_yaml(path)
    if not set(raw) & RUN_FILE_KEYS:
        raw = {"ops": raw}
    merged = _for_env(raw, path, RUN_FILE_KEYS, env)
    return {"ops": _expand(merged.get("ops") or {}),
            "resources": _plain_resources(_expand(merged.get("resources") or {})),
            "retention": _retention(merged.get("retention"), path)}


def _plain_resources(block: dict) -> dict:
    """Resource overrides as a profile writes them (``{rollout_engine: {kind: static}}``); Dagster's run-config
    shape (``{rollout_engine: {config: {kind: static}}}``) is taken too (no resource has a field named config)."""
    return {name: fields["config"] if isinstance(fields, dict) and set(fields) == {"config"} else fields
            for name, fields in block.items()}


def announce_run_file_resources(files: list[tuple[str, dict]]) -> None:
    """Hand the ``-c`` files' resource overrides to the code location this process builds (``apply_run_overrides``;
    a step process forked or started from here inherits them); none: nothing announced."""
    if any(overrides for _, overrides in files):
        os.environ[CONFIG_RESOURCES_ENV] = json.dumps([[path, overrides] for path, overrides in files if overrides])
    else:
        os.environ.pop(CONFIG_RESOURCES_ENV, None)


def apply_run_overrides(resources: dict, env: str, profile: str | None) -> dict:
    """``resources`` with the profile's overrides, then each ``-c`` file's over them (``CONFIG_RESOURCES_ENV``):
    field by field, a later file's value winning, as their ``ops`` are merged."""
    if profile:
        resources = apply_resource_overrides(resources, load_profile(profile, env)["resources"], f"profile {profile}")
    for path, overrides in read(CONFIG_RESOURCES_ENV):
        resources = apply_resource_overrides(resources, overrides, path)
    return resources


def apply_resource_overrides(resources: dict, overrides: dict[str, dict], source: str = "profile") -> dict:
    """A copy of ``resources`` with fields replaced: ``{"landing": {"prompts": ...}}``. ``ProfileError``: one line
    per unknown resource or field and per value its resource refuses, each naming ``source``."""
    out, problems = dict(resources), []
    for key, fields in overrides.items():
        if key not in out:
            problems.append(f"resources.{key}: {source} overrides unknown resource {key!r}; known: {sorted(out)}")
        elif not isinstance(fields, dict):
            problems.append(problem_line(f"resources.{key}", "a mapping of its fields expected", fields))
        else:
            replaced, wrong = _overridden(out[key], key, fields)
            out[key] = replaced if replaced is not None else out[key]
            problems += wrong
    if problems:
        raise ProfileError(joined(source, problems))
    return out


def _overridden(current, key: str, fields: dict) -> tuple[Any, list[str]]:
    """``current`` with ``fields`` replaced, or None and why not (a line per field)."""
    known = sorted(type(current).model_fields)
    unknown = [problem_line(f"resources.{key}.{name}", unknown_name_rule(name, known, "field"), value)
               for name, value in fields.items() if name not in known]
    if unknown:
        return None, unknown
    try:
        return type(current)(**{**current.model_dump(), **fields}), []
    except pydantic.ValidationError as error:
        return None, pydantic_problems(error, f"resources.{key}")


PAIR_SOURCES = ("logged", "scored", "self")
PAIR_SOURCE_ALIASES = {"both": "logged+self"}


def pair_sources(source: str) -> tuple[str, ...]:
    """The pair sources a ``dpo_pairs`` ``source`` names: one of ``PAIR_SOURCES`` or several joined by ``+``
    (``logged+scored``); ``both`` is ``logged+self``. ValueError names what is unknown."""
    parts = PAIR_SOURCE_ALIASES.get(source, source).split("+")
    unknown = [p for p in parts if p not in PAIR_SOURCES]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(f"dpo_pairs source {source!r}: each part must be one of {list(PAIR_SOURCES)}, joined by '+' "
                         f"(e.g. 'logged+scored'), each once; 'both' = 'logged+self'")
    return tuple(p for p in PAIR_SOURCES if p in parts)


def dpo_self_play(ops: dict) -> bool:
    """Whether run config ``ops`` give ``dpo_pairs`` a source that takes the policy's own scored samples
    (``self``, ``both``, ``logged+self``, ...): the DPO path then depends on the RL branch's ``rewards``
    (``assets.dpo``)."""
    config = ((ops or {}).get("dpo_pairs") or {}).get("config") or {}
    try:
        return "self" in pair_sources(config.get("source", "logged"))
    except ValueError:
        return False  # the config check names the bad source
