"""Math answer verifiers (GSM8K, MATH) and format rewards, registered in the reward registry.

All share the reward signature ``fn(prompt, response, meta) -> float`` and read the gold answer
from ``meta["answer"]`` through the one gold reader in ``rewards`` (a bare answer or a whole
solution: GSM8K's "... #### 18", MATH's "... \\boxed{\\frac12}").

Modes, as in verl's reward functions:

- strict: the response must state its answer in the task's format (``#### N`` for GSM8K, the last
  ``\\boxed{...}`` for MATH); anything else scores 0, even if the right number appears somewhere.
- flexible: the answer is read leniently (GSM8K: after ``####`` else the last number; MATH: the last
  boxed expression else the last LaTeX/plain expression ``math_verify`` finds).

MATH equivalence uses the ``math-verify`` package (LaTeX → sympy: ``\\frac``/``\\dfrac``, radicals,
intervals, sets, units and degrees stripped, symbolic equality). Without it (an install that lacks
the package) ``math_equivalent`` falls back to ``_fallback_equivalent``: normalised-string equality
or equal numeric values after ``\\frac{a}{b}``/``a/b`` evaluation — it misses radicals and symbolic
forms, so a fallback run under-credits but never over-credits.
"""
from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any, Mapping

from batchrl.training.rewards.registry import (_NUMBER, _answer_text, final_number_text, gold_number_text, register_reward,
                                     same_number)

_UNLOADED = object()
# imported on first use (pinned in pyproject.toml, installed by scripts/bootstrap.sh): sympy behind it would slow
# every process start that imports the reward registry (the Dagster process, `batchrl run`)
math_verify: Any = _UNLOADED


def _verifier():
    """``math_verify``, or None on installs without it."""
    global math_verify
    if math_verify is _UNLOADED:
        try:
            import math_verify as module
        except ImportError:  # pragma: no cover - exercised only on installs without the package
            module = None
        math_verify = module
    return math_verify

_GSM8K_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER.pattern + r")")
_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def gsm8k_answer(text: str, mode: str = "flexible") -> str | None:
    """The answer of a GSM8K-style text as written. strict: the number right after the last ``####``
    (signs, thousands separators, decimals, a ``$``); flexible: ``rewards.final_number_text``."""
    if mode == "flexible":
        return final_number_text(text)
    if mode != "strict":
        raise ValueError(f"mode must be 'strict' or 'flexible', got {mode!r}")
    matches = _GSM8K_STRICT.findall(text)
    return matches[-1] if matches else None


def _gsm8k_score(response: str, meta: Mapping[str, Any], mode: str) -> float:
    """Exact comparison (``rewards.same_number``): GSM8K answers are integers or short decimals."""
    return float(same_number(gsm8k_answer(response, mode), gold_number_text(meta)))


@register_reward("gsm8k_strict", needs=("answer",))
def gsm8k_strict(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response ends its solution with ``#### N`` and N equals the gold answer's final
    number ("#### 1,234.0" = 1234; "-5" ≠ "5"); 0.0 without ``####`` even if the number is right."""
    return _gsm8k_score(response, meta, "strict")


@register_reward("gsm8k_flexible", needs=("answer",))
def gsm8k_flexible(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response's final number (after ``####``, else its last number) equals the gold
    answer's final number; 0.0 otherwise. "So she has 18 eggs." scores 1 for gold "... #### 18"."""
    return _gsm8k_score(response, meta, "flexible")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces matched), or of a
    brace-less ``\\boxed 5``; None when there is none or its braces never close."""
    cmd, start = max(((c, text.rfind(c)) for c in _BOXED_COMMANDS), key=lambda pair: pair[1])
    if start < 0:
        return None
    rest = text[start + len(cmd):]
    if not rest.lstrip().startswith("{"):
        token = rest.split()[:1] if rest[:1].isspace() else []
        return token[0].rstrip("$.") or None if token else None
    depth, body = 0, rest.lstrip()
    for i, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return body[1:i].strip()
    return None


def _timeout() -> int | None:
    # math_verify times out with SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equivalent(gold: str, predicted: str) -> bool:
    """Whether two answer expressions (LaTeX or plain) are mathematically equal."""
    verifier = _verifier()
    if verifier is None:
        return _fallback_equivalent(gold, predicted)
    timeout = _timeout()
    gold_parsed = verifier.parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = verifier.parse(f"${predicted}$", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return _normalise(gold) == _normalise(predicted)
    return bool(verifier.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def _normalise(expr: str) -> str:
    expr = re.sub(r"\\text\{[^}]*\}|\\left|\\right|\\!|\\,|\\;|\\ |\$|\s", "", expr)
    expr = expr.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "")
    expr = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", expr)  # \frac12 shorthand
    return expr.rstrip(".")


def _value(expr: str) -> Fraction | None:
    expr = _normalise(expr).replace(",", "")
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(-?\d+)|(-?\d+(?:\.\d+)?)", expr)
    if not match:
        return None
    sign, num, den, num2, den2, plain = match.groups()
    if plain is not None:
        return Fraction(plain)
    top, bottom = (num, den) if num is not None else (num2, den2)
    if int(bottom) == 0:
        return None
    value = Fraction(int(top), int(bottom))
    return -value if sign else value


def _fallback_equivalent(gold: str, predicted: str) -> bool:
    """Without math_verify: equal after normalisation, or equal rational values."""
    if _normalise(gold) == _normalise(predicted):
        return True
    a, b = _value(gold), _value(predicted)
    return a is not None and a == b


def gold_math_answer(meta: Mapping[str, Any]) -> str | None:
    """The gold MATH answer: the last boxed expression of a solution, else the whole answer text."""
    text = _answer_text(meta)
    if text is None:
        return None
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()


def _flexible_prediction(response: str) -> str | None:
    if last_boxed(response) is not None:
        return last_boxed(response)
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1].strip()
    verifier = _verifier()
    if verifier is not None:
        parsed = verifier.parse(response, parsing_timeout=_timeout())
        return parsed[-1] if parsed and isinstance(parsed[-1], str) else None
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


@register_reward("math_strict", needs=("answer",))
def math_strict(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response's last ``\\boxed{...}`` is equivalent to the gold answer
    (``math_equivalent``: "\\dfrac12" = "\\frac{1}{2}" = "0.5"; "\\sqrt8" = "2\\sqrt2"); 0.0 when
    nothing is boxed or it differs."""
    gold, got = gold_math_answer(meta), last_boxed(response)
    return float(gold is not None and got is not None and math_equivalent(gold, got))


@register_reward("math_flexible", needs=("answer",))
def math_flexible(prompt: str, response: str, meta: dict) -> float:
    """Like ``math_strict`` but the answer may also be in ``<answer>...</answer>`` or be the last
    expression of the text ("... so x = 1/2")."""
    gold, got = gold_math_answer(meta), _flexible_prediction(response)
    return float(gold is not None and got is not None and math_equivalent(gold, got))


@register_reward("format_boxed")
def format_boxed(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response contains a closed, non-empty ``\\boxed{...}``; the answer is not checked."""
    return float(bool(last_boxed(response)))


@register_reward("format_answer_tag")
def format_answer_tag(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response contains exactly one non-empty ``<answer>...</answer>`` block."""
    tagged = _ANSWER_TAG.findall(response)
    return float(len(tagged) == 1 and bool(tagged[0].strip()))


@register_reward("format_final_mark")
def format_final_mark(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response states a GSM8K final answer ``#### N`` (the strict format)."""
    return float(gsm8k_answer(response, "strict") is not None)


def gsm8k_benchmark_answer(response: str) -> str | None:
    """The answer the GSM8K benchmark reads: the number after the last ``####``, else the number in the last
    ``\\boxed{}`` (an instruct model's habit: "\\boxed{18}", "\\boxed{\\$1,200}"), else the last number."""
    marked = gsm8k_answer(response, "strict")
    if marked is not None:
        return marked
    boxed = last_boxed(response)
    numbers = _NUMBER.findall(boxed) if boxed else []
    return numbers[-1] if numbers else final_number_text(response)


@register_reward("gsm8k", needs=("answer",))
def gsm8k_benchmark(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff ``gsm8k_benchmark_answer(response)`` equals the gold answer's final number (``same_number``):
    ``#### 18``, ``\\boxed{18}`` and "... so 18 eggs." all score 1 for gold "... #### 18"."""
    return float(same_number(gsm8k_benchmark_answer(response), gold_number_text(meta)))


@register_reward("format_gsm8k")
def format_gsm8k(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response states its final answer in a format the benchmark reads first: ``#### N`` or a
    ``\\boxed{}`` holding a number (the last-number fallback is not a format)."""
    boxed = last_boxed(response)
    return float(gsm8k_answer(response, "strict") is not None or bool(boxed and _NUMBER.search(boxed)))
