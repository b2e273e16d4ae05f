"""Estimators and policy losses by name: the lookups import the modules that register them (torch) at the first call,
so ``registry`` itself stays free of torch and of its users (the defining modules import the registry, never the
reverse)."""
from __future__ import annotations

from .registry import ADV_ESTIMATORS, POLICY_LOSSES


def _definitions() -> None:
    """Import the modules that register the functions (torch), once, at the first lookup."""
    from . import advantages, offline, policy_loss  # noqa: F401  (a static import: code versions follow it)


def _lookup(registry: dict, kind: str, name: str):
    _definitions()
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(registry)}") from None


def get_adv_estimator(name: str):
    """Advantage estimator by name (keys of ``names.ADV_ESTIMATOR_NEEDS``)."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str):
    """Policy loss by name (``names.POLICY_LOSS_NAMES``); all share ``compute_policy_loss``'s signature."""
    return _lookup(POLICY_LOSSES, "policy loss", name)
