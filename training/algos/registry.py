"""Name -> function registries for advantage estimators and policy losses (config strings).

Each estimator registers itself next to its definition with what its inputs need beyond
token-level rewards and the response mask (the same as declared in ``names.py``, where run configs find
their choices without importing torch), so a run config can be checked before anything runs:

- ``groups``: several responses per prompt (``index``); the estimator compares within a group;
- ``values``: per-token critic predictions (a value model);
- ``reward_baselines``: one baseline score per response (ReMax: the greedy response's reward).
"""

from __future__ import annotations

from typing import Callable

from .names import ADV_ESTIMATOR_NEEDS, NEEDS, POLICY_LOSS_NAMES

ADV_ESTIMATORS: dict[str, Callable] = {}  # filled as the definitions are imported (``lookup._definitions``)
POLICY_LOSSES: dict[str, Callable] = {}


def register_adv_estimator(name: str, *, needs: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"estimator {name!r}: unknown needs {sorted(unknown)}; expected some of {NEEDS}")
    if ADV_ESTIMATOR_NEEDS.get(name) != frozenset(needs):
        raise ValueError(f"estimator {name!r} with needs {sorted(needs)}: declare it in algos/names.py "
                         "(ADV_ESTIMATOR_NEEDS: what run configs may choose, known without torch)")

    def decorate(fn: Callable) -> Callable:
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorate


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    if name not in POLICY_LOSS_NAMES:
        raise ValueError(f"policy loss {name!r}: declare it in algos/names.py (POLICY_LOSS_NAMES)")

    def decorate(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn

    return decorate


def estimator_needs(name: str) -> frozenset[str]:
    """What estimator ``name`` needs besides rewards and mask (subset of ``NEEDS``); no torch import."""
    try:
        return ADV_ESTIMATOR_NEEDS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {sorted(ADV_ESTIMATOR_NEEDS)}") \
            from None
