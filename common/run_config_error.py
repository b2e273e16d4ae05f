"""The one error of a run config that cannot run: raised by the stages' own checks (``assets``) and by the
checks before a run starts (``runs.run_config``), so a caller catches one class; and the one way a config
problem is written: one line naming the key (its dotted path), the value given and the rule."""
from __future__ import annotations

from collections.abc import Iterable  # not typing: the thin client imports this module (common.environment_variables)

VALUE_CHARS = 60  # a value longer than this is cut on the line (the file has it whole)
NAMES_LISTED = 12  # an unknown name lists this many of the names it could have been, at most


class RunConfigError(ValueError):
    """A run config that Dagster's schema, a stage's library config or a whole-run check rejects (the message
    names the op and field). The one class for all of them, so a caller catches one. Several problems: one
    line each."""


def shown_value(value: object) -> str:
    """A config value as the line shows it: strings quoted, long values cut."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 1] + "…"


def problem_line(path: str, rule: str, value: object = ...) -> str:
    """``path=value: rule``; ``path: rule`` when there is no value to show (a required key not given)."""
    return f"{path}: {rule}" if value is ... else f"{path}={shown_value(value)}: {rule}"


def pydantic_problems(error, prefix: str) -> list[str]:
    """One line per error of a pydantic ``ValidationError`` of the config under ``prefix`` (``ops.X.config``):
    the key's dotted path, the value and the rule (pydantic's message, without its error URL); a model-level
    rule (``loc`` empty) names the config itself."""
    lines = []
    for item in error.errors(include_url=False):
        loc = ".".join(str(part) for part in item.get("loc", ()))
        rule = item.get("msg", "").removeprefix("Value error, ").removeprefix("Assertion failed, ")
        shown = loc and item.get("type") != "missing"
        lines.append(problem_line(f"{prefix}.{loc}" if loc else prefix, rule, item.get("input") if shown else ...))
    return lines


def joined(where: str, problems: Iterable[str]) -> str:
    """The message of several problems: one line each, every line naming where the config came from."""
    return "\n".join(f"{where}: {problem}" if where else problem for problem in problems)


def unknown_name_rule(name: str, known: list[str], what: str = "key") -> str:
    """The rule an unknown key (or asset, or resource field) breaks: the close names, else the names there are."""
    if not known:
        return f"no such {what}"
    import difflib

    close = difflib.get_close_matches(name, known, n=3)
    if close:
        return f"no such {what}; did you mean {' or '.join(close)}?"
    listed = ", ".join(known[:NAMES_LISTED]) + (f", … ({len(known)} in all)" if len(known) > NAMES_LISTED else "")
    return f"no such {what}; the {what}s: {listed}"
