"""The tiny default's supervised warm start (training/models/warm_start.py): trained on the arithmetic prompts' gold
answers, in place, seeded; the loss falls and the saved folder loads. ~10 s."""
import json
import os

import torch

from batchrl.training.models.loading import load_model_and_tokenizer

from batchrl.training.models.tiny import build_tiny_model
from batchrl.training.models.warm_start import _batch, _encoded, warm_start

ARITH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data", "arith")


def _examples() -> list[tuple[str, str]]:
    with open(os.path.join(ARITH, "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(row["prompt"], row["answer"]) for row in rows]


def _answer_loss(model_dir: str, examples) -> float:
    model, tokenizer = load_model_and_tokenizer(model_dir)
    with torch.no_grad():
        return float(model(**_batch([_encoded(tokenizer, p, a) for p, a in examples], tokenizer.pad_token_id)).loss)


def test_warm_start_lowers_the_answer_loss_in_place_and_is_seeded(tmp_path):
    examples = _examples()
    for name in ("a", "b"):
        build_tiny_model([p for p, _ in examples], str(tmp_path / name), hidden_size=64, intermediate_size=128)
    before = _answer_loss(str(tmp_path / "a"), examples[:64])
    info = warm_start(str(tmp_path / "a"), examples, steps=30, lr=3e-3, batch_size=16)
    warm_start(str(tmp_path / "b"), examples, steps=30, lr=3e-3, batch_size=16)
    assert info["warm_start_steps"] == 30 and info["warm_start_loss"] < before
    assert _answer_loss(str(tmp_path / "a"), examples[:64]) < before - 1.0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_labels_cover_the_answer_and_its_end_of_turn_only(tmp_path):
    build_tiny_model([p for p, _ in _examples()], str(tmp_path), hidden_size=64, intermediate_size=128)
    _, tokenizer = load_model_and_tokenizer(str(tmp_path))
    prompt, answer = _encoded(tokenizer, "Compute 3 + 4. Answer with a number.", "7")
    batch = _batch([(prompt, answer), (prompt[:3], answer)], tokenizer.pad_token_id)
    assert batch["labels"][0].tolist() == [-100] * len(prompt) + answer
    assert answer[-1] == tokenizer.eos_token_id and batch["attention_mask"][1].sum() == 3 + len(answer)
