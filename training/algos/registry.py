"""Name -> function registries for advantage estimators and policy losses (config strings).

Each estimator registers itself next to its definition with what its inputs need beyond
token-level rewards and the response mask, so a run config can be checked before anything runs:

- ``groups``: several responses per prompt (``index``); the estimator compares within a group;
- ``values``: per-token critic predictions (a value model);
- ``reward_baselines``: one baseline score per response (ReMax: the greedy response's reward).
"""

from __future__ import annotations

from typing import Callable

NEEDS = ("groups", "values", "reward_baselines")
ADV_ESTIMATORS: dict[str, Callable] = {}
ADV_ESTIMATOR_NEEDS: dict[str, frozenset[str]] = {}
POLICY_LOSSES: dict[str, Callable] = {}


def register_adv_estimator(name: str, *, needs: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"estimator {name!r}: unknown needs {sorted(unknown)}; expected some of {NEEDS}")

    def decorate(fn: Callable) -> Callable:
        ADV_ESTIMATORS[name] = fn
        ADV_ESTIMATOR_NEEDS[name] = frozenset(needs)
        return fn

    return decorate


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn

    return decorate


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(registry)}") from None


def get_adv_estimator(name: str):
    """Advantage estimator by name (keys of ``ADV_ESTIMATORS``)."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


def estimator_needs(name: str) -> frozenset[str]:
    """What estimator ``name`` needs besides rewards and mask (subset of ``NEEDS``)."""
    _lookup(ADV_ESTIMATORS, "advantage estimator", name)
    return ADV_ESTIMATOR_NEEDS[name]


def get_policy_loss(name: str):
    """Policy loss by name (keys of ``POLICY_LOSSES``); all share ``compute_policy_loss``'s signature."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


# The definitions register themselves on import.
from . import advantages as _advantages, policy_loss as _policy_loss  # noqa: E402,F401
