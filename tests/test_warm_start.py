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


def _taught(monkeypatch, tmp_path, **kwargs) -> tuple[list[tuple[str, str]], dict]:
    """Warm start a small tiny model on the arithmetic prompts, recording every (prompt, target) it was taught."""
    import batchrl.training.models.warm_start as module

    examples = _examples()
    build_tiny_model([p for p, _ in examples], str(tmp_path), hidden_size=32, intermediate_size=64, num_layers=1)
    _, tokenizer = load_model_and_tokenizer(str(tmp_path))
    taught, plain_batch = [], _batch

    def recording(pairs, pad_id):
        for prompt, answer in pairs:
            taught.append((tokenizer.decode(prompt), tokenizer.decode(answer[:-1])))  # the answer without its eos
        return plain_batch(pairs, pad_id)

    monkeypatch.setattr(module, "_batch", recording)
    info = warm_start(str(tmp_path), examples, lr=1e-3, batch_size=16, **kwargs)
    return taught, info


def test_the_gold_share_is_what_is_taught_and_the_rest_is_gold_plus_the_offset(tmp_path, monkeypatch):
    """q = 0.3: about 30% of the 480 drawn targets are the gold answer, every other one gold + 1 (and -2 with that
    offset), the share reported; the draws are seeded (the same twice) and differ with the seed."""
    gold = {prompt: answer for prompt, answer in _examples()}
    taught, info = _taught(monkeypatch, tmp_path / "a", steps=30, gold_share=0.3)
    answers = [(target, gold[next(p for p in gold if p in prompt)]) for prompt, target in taught]
    assert len(answers) == 480
    share = sum(target == answer for target, answer in answers) / len(answers)
    assert 0.24 < share < 0.36 and info["warm_start_gold_taught"] == share
    assert all(target == str(int(answer) + 1) for target, answer in answers if target != answer)
    again, _ = _taught(monkeypatch, tmp_path / "b", steps=30, gold_share=0.3)
    assert again == taught
    other, _ = _taught(monkeypatch, tmp_path / "c", steps=30, gold_share=0.3, seed=1)
    assert other != taught
    below, _ = _taught(monkeypatch, tmp_path / "d", steps=5, gold_share=0.3, near_miss_offset=-2)
    assert any(target == str(int(gold[next(p for p in gold if p in prompt)]) - 2) for prompt, target in below)


def test_a_gold_share_of_one_is_the_plain_warm_start(tmp_path, monkeypatch):
    """Share 1: every target gold, in the plain warm start's order (seeded passes of random.Random(seed)), whatever
    the offset; the same weights as the default call."""
    import random

    examples = _examples()
    taught, info = _taught(monkeypatch, tmp_path / "a", steps=20, gold_share=1.0, near_miss_offset=5)
    rng, order = random.Random(0), []
    while len(order) < 320:
        order += rng.sample(range(len(examples)), len(examples))
    assert [target for _, target in taught] == [examples[i][1] for i in order[:320]]
    assert info["warm_start_gold_taught"] == 1.0
    _taught(monkeypatch, tmp_path / "b", steps=20)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_a_bad_gold_share_or_near_miss_is_refused_naming_the_field(tmp_path):
    import pydantic
    import pytest

    from batchrl.assets.models import BaseModelConfig
    from batchrl.training.models.warm_start import WarmStartError, near_miss

    for share in (0, -0.1, 1.5):
        with pytest.raises(pydantic.ValidationError, match="warm_start_gold_share"):
            BaseModelConfig(warm_start_gold_share=share)
        with pytest.raises(WarmStartError, match="warm_start_gold_share"):
            warm_start(str(tmp_path), [("1 + 1", "2")], steps=1, gold_share=share)
    with pytest.raises(pydantic.ValidationError, match="warm_start_near_miss_offset: 0"):
        BaseModelConfig(warm_start_near_miss_offset=0)
    with pytest.raises(pydantic.ValidationError, match="warm_start_lr_schedule"):
        BaseModelConfig(warm_start_lr_schedule="linear")
    with pytest.raises(WarmStartError, match="'seven' is no whole number.*warm_start_gold_share: 1"):
        near_miss("seven", 1)
    assert (near_miss("14", 1), near_miss(" 0", -1)) == ("15", "-1")


def test_the_cosine_schedule_warms_up_then_decays_to_zero():
    from batchrl.training.models.warm_start import lr_at

    assert {lr_at(step, 400, 1e-3, "constant") for step in range(400)} == {1e-3}
    cosine = [lr_at(step, 400, 1e-3, "cosine") for step in range(400)]
    assert cosine[0] == 1e-3 / 40 and cosine[39] == cosine[40] == 1e-3  # 40 warmup steps, then the peak
    assert all(a > b for a, b in zip(cosine[40:], cosine[41:])) and cosine[-1] < 1e-7  # 0 one step later


def test_batchrl_run_without_a_profile_warm_starts_the_tiny_default_only(monkeypatch):
    """README command 1's recipe (resources/profiles.py EMBEDDED_DEFAULT) goes under the -c files; not with a
    profile, nor for a base model of one's own; it overrides no resource (the job stays the one the UI loads)."""
    import argparse

    import yaml

    from batchrl.cli.run_command import _run_config
    from batchrl.resources.profiles import CONFIG_RESOURCES_ENV, EMBEDDED_DEFAULT

    def run_config(tmp: str | None = None, profile: str | None = None, **file) -> tuple[dict, list]:
        monkeypatch.setenv(CONFIG_RESOURCES_ENV, "")  # _run_config announces; setenv records the undo
        monkeypatch.setenv("BATCHRL_PROFILE", "")
        paths = []
        if file:
            path = os.path.join(tmp, "run.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(file, f)
            paths = [path]
        config, _ = _run_config(argparse.Namespace(profile=profile, config=paths, rl_iterations=None))
        announced = os.environ.get(CONFIG_RESOURCES_ENV)
        return config.get("ops", {}), json.loads(announced) if announced else []

    ops, announced = run_config()
    assert ops == EMBEDDED_DEFAULT and ops["base_model"]["config"]["warm_start_gold_share"] == 0.3
    assert announced == []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ops, announced = run_config(tmp, ops={"policy_checkpoint": {"config": {"lr": 1e-5}}},
                                    resources={"rl_recipe": {"kl_placement": "none"}})
        assert ops["policy_checkpoint"]["config"] == {"lr": 1e-5}  # the file's value over the default's
        assert ops["base_model"] == EMBEDDED_DEFAULT["base_model"]
        assert announced == [[os.path.join(tmp, "run.yaml"), {"rl_recipe": {"kl_placement": "none"}}]]
        ops, announced = run_config(tmp, ops={"base_model": {"config": {"model_path": "/models/mine"}}})
        assert ops == {"base_model": {"config": {"model_path": "/models/mine"}}} and announced == []
    ops, _ = run_config(profile="real")
    assert "warm_start_steps" not in ops.get("base_model", {}).get("config", {})


def test_the_run_summary_says_what_the_tiny_default_was_taught():
    from batchrl.cli.evaluation_report import tiny_default_note

    habit = tiny_default_note({"warm_start_steps": 400, "warm_start_gold_share": 0.3, "warm_start_near_miss_offset": 1})
    assert "gold +1" in habit and "30% of the time" in habit and "RL unlearns" in habit
    assert max(len(line) for line in habit.splitlines()) <= 100
    for plain in ({}, {"warm_start_steps": 0, "warm_start_gold_share": 0.3}, {"warm_start_steps": 100,
                                                                            "warm_start_gold_share": 1.0}):
        assert "shows the pipeline, not learning" in tiny_default_note(plain)
