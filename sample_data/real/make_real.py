"""Generate the real-model task: arithmetic of five kinds + GSM8K-style word problems, train / held-out.

Run from the repo root: ``python sample_data/real/make_real.py``. Fixed seed, so the committed
``train.jsonl`` / ``heldout.jsonl`` are reproduced byte for byte. The mix is fixed here, before any
training, and both splits have the same per-kind distribution; no problem (same numbers and
operation) is in both splits. Categories (= kinds, reported separately by the evaluation):

- ``add1``: one-digit addition; ``add2``: two-digit addition; ``sub``: two-digit subtraction with a
  non-negative result; ``mul``: small multiplication (2..12 × 2..12);
- ``word``: GSM8K-style word problems (templates written for batchrl, two or three steps), whose
  prompt asks for the final answer after ``####`` as GSM8K does.

Answers are integers as strings; the ``final_answer`` reward credits the final number of a response.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # sample_data/: the generators' shared helper
from split_problems import split_problems, write_splits  # noqa: E402

SEED = 2026
PER_KIND = {"add1": (60, 40), "add2": (120, 40), "sub": (120, 40), "mul": (80, 40), "word": (120, 40)}
ASK = "Answer with a number."
WORD_ASK = "Give the final answer as a number after ####."

# (template, function of the drawn numbers) — numbers a, b, c drawn per template's ranges.
WORD_TEMPLATES = [
    ("{name} has {a} apples. She buys {b} bags with {c} apples in each bag. How many apples does she have now?",
     lambda a, b, c: a + b * c, (2, 30), (2, 6), (2, 9)),
    ("A shop sells pencils for {a} dollars each. {name} buys {b} pencils and pays with a {c}-dollar bill. "
     "How much change does {name} get?", lambda a, b, c: c - a * b, (1, 5), (2, 6), (50, 50)),
    ("{name} reads {a} pages every day for {b} days, then {c} more pages. How many pages has {name} read?",
     lambda a, b, c: a * b + c, (3, 20), (2, 7), (1, 30)),
    ("A class has {a} students. {b} of them go home early and the rest split into groups of {c}. "
     "How many full groups are there?", lambda a, b, c: (a - b) // c, (20, 40), (1, 8), (2, 5)),
    ("{name} earns {a} dollars an hour and works {b} hours. Then {name} spends {c} dollars on lunch. "
     "How many dollars are left?", lambda a, b, c: a * b - c, (8, 20), (2, 8), (5, 15)),
    ("A farm has {a} cows and {b} chickens. How many legs do the animals have in total?",
     lambda a, b, c: 4 * a + 2 * b, (2, 15), (2, 20), (0, 0)),
    ("{name} had {a} stickers, gave {b} to a friend and then got {c} new ones. How many stickers does "
     "{name} have?", lambda a, b, c: a - b + c, (20, 60), (1, 19), (1, 30)),
    ("There are {a} boxes with {b} cookies each. {name} eats {c} cookies. How many cookies are left?",
     lambda a, b, c: a * b - c, (2, 9), (4, 12), (1, 10)),
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
ARITH_PHRASES = ["What is {a} {op} {b}? " + ASK, "Compute {a} {op} {b}. " + ASK, "{a} {op} {b} = ? " + ASK]


def _arith(kind: str, rng: random.Random) -> tuple[tuple, str, int]:
    if kind == "add1":
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), "+"
    elif kind == "add2":
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), "+"
    elif kind == "sub":
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), "-"
        a, b = max(a, b), min(a, b)
    else:
        a, b, op = rng.randint(2, 12), rng.randint(2, 12), "*"
    value = a + b if op == "+" else a - b if op == "-" else a * b
    prompt = rng.choice(ARITH_PHRASES).format(a=a, op=op, b=b)
    return (kind, a, op, b), prompt, value


def _word(rng: random.Random) -> tuple[tuple, str, int]:
    index = rng.randrange(len(WORD_TEMPLATES))
    template, fn, ra, rb, rc = WORD_TEMPLATES[index]
    a, b, c = rng.randint(*ra), rng.randint(*rb), rng.randint(*rc)
    value = fn(a, b, c)
    prompt = template.format(name=rng.choice(NAMES), a=a, b=b, c=c) + " " + WORD_ASK
    return ("word", index, a, b, c), prompt, value


def _draw(kind: str, rng: random.Random) -> tuple[tuple, str, int] | None:
    key, prompt, value = _word(rng) if kind == "word" else _arith(kind, rng)
    return None if value < 0 else (key, prompt, value)


def make_rows() -> tuple[list[dict], list[dict]]:
    return split_problems(SEED, PER_KIND, _draw, id_prefix="real", heldout_first=True)


def main() -> None:
    train, heldout = make_rows()
    write_splits(Path(__file__).resolve().parent, train, heldout)


if __name__ == "__main__":
    main()
