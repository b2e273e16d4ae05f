"""Run profiles: named bundles of resource overrides and run config (``profiles/<name>.yaml``).

A profile's top level is its CPU (smoke-size) form; ``environments.<BATCHRL_ENV>`` is merged over it
(e.g. bigger batches for ``gpu``). ``resources`` override fields of the environment's resources
(``{sample_data}`` in a string is the shipped sample-data folder), ``ops`` is Dagster run config,
``rl_iterations`` the default number of on-policy iterations of ``batchrl run``.
"""
from __future__ import annotations

import os
from typing import Any

import yaml

from batchrl.common.package import PACKAGE_DIR

PROFILE_DIR = os.path.join(PACKAGE_DIR, "profiles")
SAMPLE_DATA = os.path.join(PACKAGE_DIR, "sample_data")


class ProfileError(ValueError):
    """An unknown profile or a malformed profile file (the message names the file)."""


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


def load_profile(name: str, env: str | None = None) -> dict[str, Any]:
    """``{"resources": {...}, "ops": {...}, "rl_iterations": int, "description": str}`` of a profile."""
    path = name if name.endswith(".yaml") else os.path.join(PROFILE_DIR, f"{name}.yaml")
    if not os.path.exists(path):
        raise ProfileError(f"unknown profile {name!r}: no {path}; known: {available_profiles()}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    unknown = set(raw) - {"description", "rl_iterations", "resources", "ops", "environments"}
    if unknown:
        raise ProfileError(f"{path}: unknown top-level keys {sorted(unknown)}")
    env = env or os.environ.get("BATCHRL_ENV", "local")
    merged = deep_merge({k: v for k, v in raw.items() if k != "environments"},
                       (raw.get("environments") or {}).get(env) or {})
    return {"description": merged.get("description", ""), "rl_iterations": int(merged.get("rl_iterations", 1)),
            "resources": _expand(merged.get("resources") or {}), "ops": _expand(merged.get("ops") or {})}


def apply_resource_overrides(resources: dict, overrides: dict[str, dict]) -> dict:
    """A copy of ``resources`` with fields replaced: ``{"landing": {"prompts": ...}}``."""
    out = dict(resources)
    for key, fields in overrides.items():
        if key not in out:
            raise ProfileError(f"profile overrides unknown resource {key!r}; known: {sorted(out)}")
        current = out[key]
        out[key] = type(current)(**{**current.model_dump(), **fields})
    return out


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
