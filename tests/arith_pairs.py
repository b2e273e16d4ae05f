"""A tiny base model and arithmetic preference pairs (chosen = gold answer, rejected = answer + offset)."""
import json
import os

import pandas as pd

from batchrl.training.models.tiny import build_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH = [json.loads(line) for line in open(os.path.join(REPO, "sample_data", "arith", "train.jsonl"))]
ARITH_EVAL = [json.loads(line) for line in open(os.path.join(REPO, "sample_data", "arith", "eval.jsonl"))]


def build_arith_model(path) -> str:
    """The tiny default model (default dims, seed 0) trained on the arithmetic texts."""
    build_tiny_model([r["prompt"] + " " + r["answer"] for r in ARITH], str(path), seed=0)
    return str(path)


def build_arith_pairs(root, *, rejected_offset: int, n_pairs: int = 32) -> dict:
    """Writes ``root/base`` (tiny model) and ``root/pairs.parquet``; returns their paths."""
    build_tiny_model([r["prompt"] + " " + r["answer"] for r in ARITH], str(root / "base"), seed=0,
                     hidden_size=64, intermediate_size=128)
    pairs = [{"id": r["id"], "prompt": r["prompt"], "chosen": r["answer"],
              "rejected": str(int(r["answer"]) + rejected_offset)} for r in ARITH[:n_pairs]]
    pd.DataFrame(pairs).to_parquet(root / "pairs.parquet")
    return {"pairs_parquet": str(root / "pairs.parquet"), "model_path": str(root / "base")}
