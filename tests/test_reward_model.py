import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from transformers import AutoModelForSequenceClassification

from batchrl.training.rewards.registry import RewardConfig, compute_rewards, score_with_reward_model
from batchrl.training.models.tiny import build_tiny_model
from batchrl.training.trainer.config import RewardModelConfig
from batchrl.training.trainer.reward import train_reward_model

ARITH = Path(__file__).resolve().parents[1] / "sample_data" / "arith"
WORDS = [("yes", "no"), ("good", "bad"), ("right", "wrong"), ("correct", "incorrect")]


def toy_pairs(n=32):
    """Separable: the chosen response starts with the 'positive' word of one of four word pairs."""
    rows = [json.loads(line) for line in (ARITH / "train.jsonl").read_text().splitlines()][:n]
    return pd.DataFrame(
        [
            {"prompt": r["prompt"], "chosen": f"{WORDS[i % 4][0]} {r['answer']}", "rejected": f"{WORDS[i % 4][1]} {r['answer']}"}
            for i, r in enumerate(rows)
        ]
    )


def train_on(pairs: pd.DataFrame, base: str, out: Path, **config) -> dict:
    """Train through the DeepSpeed trainer stage (CPU, gloo), as the reward_model asset's job does."""
    out.mkdir(parents=True, exist_ok=True)
    pairs.to_parquet(out / "pairs.parquet")
    cfg = RewardModelConfig(**{"epochs": 2, "micro_batch_size": 8, "seed": 0, **config})
    return train_reward_model(cfg, pairs_parquet=str(out / "pairs.parquet"), model_path=base, out_dir=str(out))


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    rows = [json.loads(line) for line in (ARITH / "train.jsonl").read_text().splitlines()]
    out = tmp_path_factory.mktemp("tiny") / "base"
    build_tiny_model([f"{r['prompt']} {r['answer']}" for r in rows] + [" ".join(w) for w in WORDS], str(out))
    return str(out)


@pytest.fixture(scope="module")
def trained(base_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "rm"
    return train_on(toy_pairs(), base_path, out)


def test_training_raises_train_accuracy(trained):
    assert trained["train_accuracy_after"] == 1.0
    assert trained["train_accuracy_after"] > trained["train_accuracy_before"]
    assert trained["train_loss_after"] < trained["train_loss_before"] - 0.3
    assert trained["global_step"] == 8 and len(trained["loss_curve"]) == 8


def test_saved_folder_is_hf_sequence_classifier(trained):
    model = AutoModelForSequenceClassification.from_pretrained(trained["model_dir"])
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    assert (Path(trained["model_dir"]) / "model.safetensors").exists() and (Path(trained["model_dir"]) / "tokenizer.json").exists()


def test_deterministic_for_seed(trained, base_path, tmp_path):
    again = train_on(toy_pairs(), base_path, tmp_path / "again")
    digest = lambda p: hashlib.sha256((Path(p) / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(again["model_dir"]) == digest(trained["model_dir"])
    assert again["loss_curve"] == trained["loss_curve"]


def test_resumes_exactly_and_caps_pairs(trained, base_path, tmp_path):
    train_on(toy_pairs(), base_path, tmp_path / "cut", stop_after_steps=3)
    resumed = train_on(toy_pairs(), base_path, tmp_path / "cut")
    assert resumed["resumed_from_step"] == 3
    np.testing.assert_allclose(resumed["loss_curve"], trained["loss_curve"], atol=1e-6)
    capped = train_on(toy_pairs(), base_path, tmp_path / "capped", max_pairs=16, epochs=1)
    assert capped["num_pairs"] == 16 and capped["global_step"] == 2


def test_rm_scores_and_reward_mix(trained):
    pairs = toy_pairs()
    chosen = score_with_reward_model(trained["model_dir"], pairs["prompt"].tolist(), pairs["chosen"].tolist(), batch_size=5)
    rejected = score_with_reward_model(trained["model_dir"], pairs["prompt"].tolist(), pairs["rejected"].tolist())
    assert chosen.shape == (32,) and chosen.dtype == np.float32
    assert (chosen > rejected).all()
    rows = [
        {"prompt": "What is 1 + 1?", "response": "yes 2", "answer": "2", "category": "arith"},
        {"prompt": "Say something", "response": "no 5", "answer": None, "category": "chat"},
    ]
    routing = {"arith": {"rule": 1.0}, "chat": {"reward_model": 1.0}}
    out = compute_rewards(rows, RewardConfig(rule="arith_exact", routing=routing), reward_model_path=trained["model_dir"])
    rm = score_with_reward_model(trained["model_dir"], [r["prompt"] for r in rows], [r["response"] for r in rows])
    np.testing.assert_allclose(out["reward_model"], rm, atol=1e-6)
    np.testing.assert_allclose(out["reward"], [1.0, rm[1]], atol=1e-6)
    # the GPU environment scores in bfloat16 (its compute dtype): the same ranking, bf16-close scores
    half = compute_rewards(rows, RewardConfig(rule="arith_exact", routing=routing),
                           reward_model_path=trained["model_dir"], dtype="bfloat16")
    assert not np.array_equal(half["reward_model"], out["reward_model"])  # it did run in bfloat16
    np.testing.assert_allclose(half["reward_model"], out["reward_model"], atol=0.05 * np.abs(rm).max() + 0.02)
    half_chosen = score_with_reward_model(trained["model_dir"], pairs["prompt"].tolist(), pairs["chosen"].tolist(),
                                          dtype="bfloat16")
    assert half_chosen.dtype == np.float32 and (half_chosen > rejected).mean() >= 0.9


def test_rm_scoring_tokenises_while_the_model_loads_with_the_same_scores(trained, monkeypatch):
    import threading

    from batchrl.training.rewards import reward_model as rm_module

    pairs = toy_pairs()
    model, tokenizer = rm_module.load_reward_model(trained["model_dir"])
    serial = rm_module.score_texts(model, tokenizer, pairs["prompt"].tolist(), pairs["chosen"].tolist(), batch_size=5)
    seen = []
    real_encode, real_load = rm_module.encode_scored, rm_module.load_reward_model
    monkeypatch.setattr(rm_module, "encode_scored", lambda *a, **k: seen.append(("encode", threading.current_thread().name))
                        or real_encode(*a, **k))
    monkeypatch.setattr(rm_module, "load_reward_model", lambda *a, **k: seen.append(
        ("load", threading.current_thread().name)) or real_load(*a, **k))
    overlapped = score_with_reward_model(trained["model_dir"], pairs["prompt"].tolist(), pairs["chosen"].tolist(),
                                         batch_size=5)
    np.testing.assert_allclose(overlapped, serial, atol=1e-6)
    assert ("load", threading.current_thread().name) in seen
    assert any(kind == "encode" and name.startswith("tokenise") for kind, name in seen)


def test_empty_pairs_rejected(base_path, tmp_path):
    with pytest.raises(ValueError, match="no preference pairs"):
        train_on(toy_pairs().iloc[:0], base_path, tmp_path / "x")


def test_scores_in_input_order_whatever_the_batching(trained):
    from batchrl.training.rewards.reward_model import load_reward_model, reward_scores, score_texts

    model, tokenizer = load_reward_model(trained["model_dir"])
    pairs = toy_pairs(13)
    prompts, responses = pairs["prompt"].tolist(), [c * (1 + i % 4) for i, c in enumerate(pairs["chosen"])]
    one_by_one = np.array([float(reward_scores(model, tokenizer, [p], [r], max_length=64)[0])
                           for p, r in zip(prompts, responses)])
    for options in (dict(batch_size=4), dict(max_tokens=40), dict(batch_size=100)):
        got = score_texts(model, tokenizer, prompts, responses, max_length=64, **options)
        np.testing.assert_allclose(got, one_by_one, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(one_by_one, 4))) > 5  # distinct scores: a misordered result would show



def test_training_steps_call_the_model_not_the_deepspeed_engine(base_path, tmp_path, monkeypatch):
    """The loop's bf16 autocast (``precision: bf16_amp`` on GPUs) must reach the model's matmuls, and
    DeepSpeed's own forward turns a surrounding CUDA autocast off inside itself: steps called through
    the engine ran in fp32 (found on the H200: 3.4x the GPU time per reward-model step). So the trainers'
    forward passes call the engine's module (``TrainLoop.model``), never the engine."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    calls = []
    real_forward = DeepSpeedEngine.forward
    monkeypatch.setattr(DeepSpeedEngine, "forward",
                        lambda self, *args, **kwargs: calls.append(1) or real_forward(self, *args, **kwargs))
    result = train_on(toy_pairs(16), base_path, tmp_path / "rm", epochs=1)
    assert result["global_step"] > 0 and not calls
