"""Prompt-set shapes: how a published prompt file's rows become ``prompt`` + gold ``answer``, by config alone.

- ``plain``: rows already carry ``prompt`` (+ ``answer``, ...) after ``field_mapping`` (training/data/prompts.py).
- ``gsm8k``: the original GSM8K release (``{"question", "answer"}``, the answer a worked solution ending in
  ``#### N``): prompt = question + the configured suffix, gold = N exactly as written after the last ``####``
  (thousands separators dropped). A row without ``####`` (or with no number after it) has no gold answer to
  reward against: it is quarantined with reason ``missing_gold_answer``, never trained on with a wrong gold.

The default suffix is verl's GSM8K instruction, so accuracies compare with its published numbers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SHAPES = ("plain", "gsm8k")
VERL_GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
_GSM8K_GOLD = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


class QuarantinedPrompt(ValueError):
    """A row the shape cannot turn into a prompt with a gold answer: ``reason`` is its code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class PromptQuarantine:
    """Rows left out of a prompt set, each with where it was, why, and its raw text (nothing lost)."""

    rows: list[dict] = field(default_factory=list)

    def add(self, where: str, reason: str, detail: str, raw: str) -> None:
        self.rows.append({"where": where, "reason": reason, "detail": detail, "raw": raw})

    def reasons(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row["reason"]] = counts.get(row["reason"], 0) + 1
        return counts


def gsm8k_gold(solution: object) -> str:
    """The number after the last ``####`` of a GSM8K solution, or QuarantinedPrompt(missing_gold_answer)."""
    matches = _GSM8K_GOLD.findall(solution) if isinstance(solution, str) else []
    if not matches:
        raise QuarantinedPrompt("missing_gold_answer", f"field 'answer' has no '#### <number>': {str(solution)[-80:]!r}")
    return matches[-1].replace(",", "")


def shape_row(row: dict, shape: str, suffix: str | None) -> dict:
    """``row`` in the ``plain`` contract (``prompt``, ``answer``, ...) for ``shape``."""
    if shape == "plain":
        return row if not suffix or not isinstance(row.get("prompt"), str) else {**row, "prompt": row["prompt"] + suffix}
    if shape == "gsm8k":
        question = row.get("question", row.get("prompt"))
        if not isinstance(question, str) or not question.strip():
            raise QuarantinedPrompt("missing_field", "field 'question' must be a non-empty string")
        gold = gsm8k_gold(row.get("answer"))
        text = question.strip() + (VERL_GSM8K_SUFFIX if suffix is None else suffix)
        return {**{k: v for k, v in row.items() if k != "question"}, "prompt": text, "answer": gold,
                "solution": row.get("answer"), "category": row.get("category") or "gsm8k"}
    raise ValueError(f"prompt shape must be one of {list(SHAPES)}, got {shape!r}")
