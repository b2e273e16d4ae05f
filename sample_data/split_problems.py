"""What the task generators (``real/make_real.py``, ``tools/make_tools.py``) share: distinct problems per kind from
one seeded generator, split into train and held-out with the same per-kind mix and no problem in both, shuffled,
numbered, written as JSONL with sorted keys (so a rerun reproduces the committed files byte for byte)."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

# draw(kind, rng) -> (key: the problem's identity, prompt, integer answer), or None for a draw to skip
Draw = Callable[[str, random.Random], "tuple[tuple, str, int] | None"]


def split_problems(seed: int, per_kind: dict[str, tuple[int, int]], draw: Draw, *, id_prefix: str,
                   heldout_first: bool = False) -> tuple[list[dict], list[dict]]:
    """``per_kind``: kind -> (train rows, held-out rows). Each kind's distinct problems are taken in drawing order,
    the held-out ones first where ``heldout_first`` (else the train ones); ids ``<id_prefix>-<split>-NNNN``."""
    rng = random.Random(seed)
    train, heldout = [], []
    for kind, (n_train, n_heldout) in per_kind.items():
        seen: set[tuple] = set()
        rows = []
        while len(rows) < n_train + n_heldout:
            drawn = draw(kind, rng)
            if drawn is None or drawn[0] in seen:
                continue
            key, prompt, value = drawn
            seen.add(key)
            rows.append({"prompt": prompt, "answer": str(value), "category": kind})
        if heldout_first:
            heldout, train = heldout + rows[:n_heldout], train + rows[n_heldout:]
        else:
            train, heldout = train + rows[:n_train], heldout + rows[n_train:]
    rng.shuffle(train)
    rng.shuffle(heldout)
    return ([{"id": f"{id_prefix}-train-{i:04d}", **r} for i, r in enumerate(train)],
            [{"id": f"{id_prefix}-heldout-{i:04d}", **r} for i, r in enumerate(heldout)])


def write_splits(folder: Path, train: list[dict], heldout: list[dict]) -> None:
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        (folder / name).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
