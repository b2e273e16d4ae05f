"""Generate the toy rule-reward task: single-digit additions with gold answers.

Run from the repo root: ``python sample_data/arith/make_arith.py``. Fixed seed, so the committed
``train.jsonl``/``eval.jsonl`` are reproduced byte for byte. All 100 pairs (a, b) in 0..9 are
rendered with three phrasings (300 prompts), shuffled, and split 250 train / 50 eval: eval
shares number pairs with train but usually in another phrasing, so it measures the skill,
not a memorised string.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 1234
N_EVAL = 50
TEMPLATES = [
    "What is {a} + {b}? Answer with a number.",
    "Compute {a} + {b}. Answer with a number.",
    "{a} + {b} = ? Answer with a number.",
]


def make_rows() -> list[dict]:
    rows = [
        {"prompt": t.format(a=a, b=b), "answer": str(a + b), "category": "arith"}
        for t in TEMPLATES
        for a in range(10)
        for b in range(10)
    ]
    random.Random(SEED).shuffle(rows)
    return [{"id": f"arith-{i:04d}", **row} for i, row in enumerate(rows)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def main() -> None:
    here = Path(__file__).resolve().parent
    rows = make_rows()
    write_jsonl(here / "eval.jsonl", rows[:N_EVAL])
    write_jsonl(here / "train.jsonl", rows[N_EVAL:])


if __name__ == "__main__":
    main()
