"""Generate the tool task: arithmetic too large to do in the head, train / held-out (issue 35).

Run from the repo root: ``python sample_data/tools/make_tools.py``. Fixed seed, so the committed ``train.jsonl`` /
``heldout.jsonl`` are reproduced byte for byte; no problem (same numbers and operation) is in both splits, and both
have the same per-kind mix. Categories (= kinds, reported separately by the evaluation):

- ``mul``: a product of a 3-4-digit and a 3-4-digit number (``What is 4821 * 937?``);
- ``sum``: the sum of a list of 8-12 numbers of 3-4 digits;
- ``muladd``: ``a * b + c`` with 3-digit a, b and a 4-digit c.

Answers are integers as strings; the ``final_answer`` reward credits the final number of the last model turn.
A small model gets these right by writing ``print(4821 * 937)`` and reading the output, rarely without a tool.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # sample_data/: the generators' shared helper
from split_problems import split_problems, write_splits  # noqa: E402

SEED = 3535
PER_KIND = {"mul": (160, 40), "sum": (120, 30), "muladd": (120, 30)}
ASK = "Answer with a number."


def _problem(kind: str, rng: random.Random) -> tuple[tuple, str, int]:
    if kind == "mul":
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        return (kind, a, b), f"What is {a} * {b}? {ASK}", a * b
    if kind == "sum":
        values = [rng.randint(100, 9999) for _ in range(rng.randint(8, 12))]
        return (kind, *values), f"What is the sum of {', '.join(map(str, values))}? {ASK}", sum(values)
    a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(1000, 9999)
    return (kind, a, b, c), f"What is {a} * {b} + {c}? {ASK}", a * b + c


def make_rows() -> tuple[list[dict], list[dict]]:
    return split_problems(SEED, PER_KIND, _problem, id_prefix="tools")


def main() -> None:
    train, heldout = make_rows()
    write_splits(Path(__file__).resolve().parent, train, heldout)


if __name__ == "__main__":
    main()
