"""Feedback labels (thumbs) as booleans, matched by value.

A label may be logged as a bool, a number or text, and a YAML mapping may be written with int keys
(``{1: false, 5: true}``) or string keys (``{"1": false}``). Both sides are reduced to one canonical text
(``label_key``) so that 5, "5", 5.0 and " 5 " are the same label. The user's ``label_values`` are looked up
first: they win over the built-in thumbs values (a 1-5 rating maps 1 to false although "1" means up).
"""
from __future__ import annotations

from typing import Any

#: thumbs values understood without config (case-insensitive; ``IngestConfig.label_values`` adds more)
BUILTIN_LABELS: dict[str, bool] = {
    "true": True, "false": False, "1": True, "0": False, "up": True, "down": False,
    "thumbs_up": True, "thumbs_down": False, "thumbsup": True, "thumbsdown": False, "+1": True, "-1": False,
    "good": True, "bad": False, "like": True, "dislike": False, "positive": True, "negative": False,
    "yes": True, "no": False, "\U0001f44d": True, "\U0001f44e": False,
}


def _number_key(number: int | float) -> str:
    # 5 and 5.0 are one label; other floats keep their shortest exact text (0.5)
    if isinstance(number, float) and number.is_integer():
        return str(int(number))
    return str(number)


def label_key(value: Any) -> str | None:
    """The canonical text of a label value: ``true``/``false`` for booleans, the number for numbers and
    numeric text (``5``, ``"5"``, ``5.0``, ``"5.0"`` -> ``"5"``), other text stripped and lower-cased;
    None for anything else (objects, lists, null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _number_key(value)
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            return _number_key(float(text))
        except ValueError:
            return text
    return None


BUILTIN_KEYS: dict[str, bool] = {label_key(k): v for k, v in BUILTIN_LABELS.items()}


def canonical_label_values(values: dict) -> dict[str, bool]:
    """``label_values`` with canonical keys; two keys that name one label with different values (``{5: true,
    "5.0": false}``) are refused, naming both."""
    out: dict[str, bool] = {}
    written: dict[str, Any] = {}
    for key, flag in values.items():
        canonical = label_key(key)
        if canonical is None:
            raise ValueError(f"label_values: key {key!r} is not a label (a bool, number or text)")
        if canonical in out and out[canonical] != flag:
            raise ValueError(f"label_values: keys {written[canonical]!r} and {key!r} are the same label "
                             f"{canonical!r} with different values")
        out[canonical], written[canonical] = flag, key
    return out


def thumbs(value: Any, user: dict[str, bool]) -> bool | None:
    """The boolean of a logged label: the user's mapping (canonical keys) first, then a bool as it is, then
    the built-in thumbs values; None when neither knows it."""
    key = label_key(value)
    if key in user:
        return user[key]
    if isinstance(value, bool):
        return value
    return BUILTIN_KEYS.get(key)
