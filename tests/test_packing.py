"""Packed micro-batches (``policy_checkpoint.pack_samples``): the same log-probs, gradients and policy update as
one padded row per rollout, with fewer tokens computed."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

from batchrl.training.data.batch_layout import completion_logprobs, pad_prompt_completion
from batchrl.training.data.packing import first_fit_rows, pack_prompt_completion
from batchrl.training.models.loading import load_model_and_tokenizer
from batchrl.training.models.tiny import build_tiny_model
from batchrl.training.trainer.config import PolicyConfig
from batchrl.training.trainer.policy import train_policy

ARITH = [json.loads(line) for line in open("sample_data/arith/train.jsonl")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("packing") / "base")
    build_tiny_model([r["prompt"] + " " + r["answer"] for r in ARITH], path, seed=0, hidden_size=64,
                     intermediate_size=128)
    return path


def _ragged(n: int, seed: int, vocab: int = 100) -> tuple[list[list[int]], list[list[int]]]:
    """RL-shaped rows: prompts of 3-12 tokens, most answers short, a few at the length limit (24)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(3, 13)).tolist() for _ in range(n)]
    completions = [rng.integers(3, vocab, 24 if rng.random() < 0.2 else rng.integers(1, 8)).tolist()
                   for _ in range(n)]
    return prompts, completions


def test_rows_hold_every_sequence_once_within_the_width():
    lengths = [9, 3, 7, 1, 5, 9, 2, 4]
    rows = first_fit_rows(lengths, 9)
    assert sorted(i for row in rows for i in row) == list(range(8))
    assert all(sum(lengths[i] for i in row) <= 9 for row in rows)
    assert len(rows) == 5 and rows == first_fit_rows(lengths, 9)  # 40 tokens in 5 rows of 9; deterministic


def test_packed_layout_holds_each_sequence_with_its_own_positions():
    prompts, completions = _ragged(16, 0)
    packed = pack_prompt_completion(prompts, completions, pad_id=0)
    padded = pad_prompt_completion(prompts, completions, pad_id=0)
    assert torch.equal(packed["responses"], padded["responses"])
    assert torch.equal(packed["response_mask"], padded["response_mask"].float())
    rows, width = packed["input_ids"].shape
    assert width == max(len(p) + len(c) for p, c in zip(prompts, completions))
    real = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    assert rows * width < 0.75 * padded["input_ids"].numel() and rows * width >= real
    flat_ids, flat_pos = packed["input_ids"].reshape(-1), packed["position_ids"].reshape(-1)
    # the hidden state at packed_index predicts the completion token one place to its right
    targets = packed["responses"].reshape(-1)[packed["packed_slot"]]
    assert torch.equal(flat_ids[packed["packed_index"] + 1], targets)
    assert len(packed["packed_index"]) == sum(map(len, completions))
    assert (flat_pos[packed["packed_index"] + 1] >= 1).all()  # a completion token is never a sequence's first


@pytest.mark.parametrize("fused", [True, False])
def test_packed_log_probs_and_gradients_equal_padded(tiny, fused):
    model, _ = load_model_and_tokenizer(tiny)
    model.train()
    prompts, completions = _ragged(24, 1, model.config.vocab_size)
    results = {}
    for name, layout in (("padded", pad_prompt_completion), ("packed", pack_prompt_completion)):
        model.zero_grad()
        logp, entropy = completion_logprobs(model, layout(prompts, completions, 0), with_entropy=True, fused=fused)
        mask = pad_prompt_completion(prompts, completions, 0)["response_mask"].float()
        ((logp * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        results[name] = (logp.detach(), (entropy * mask).detach(), grads)
    for got, want in zip(results["packed"], results["padded"]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    # what the position ids do: counted across the whole row instead, sequences see each other and values move
    leaky = pack_prompt_completion(prompts, completions, 0)
    leaky["position_ids"] = torch.arange(leaky["input_ids"].shape[1]).expand_as(leaky["input_ids"]).clone()
    with torch.no_grad():
        moved = completion_logprobs(model, leaky, fused=fused)
    assert (moved - results["padded"][0]).abs().max() > 1e-2


def test_packed_update_equals_padded(tiny, tmp_path):
    """A whole policy update (old log-probs, KL to the reference, 3 optimiser steps) packed and padded: the same
    loss curve and weights up to float rounding."""
    prompts, completions = _ragged(48, 2, load_model_and_tokenizer(tiny)[0].config.vocab_size)
    rng = np.random.default_rng(3)
    rewards = rng.random(48)
    pd.DataFrame({"prompt_ids": prompts, "response_ids": completions, "reward": rewards,
                  "advantages": [[float(r - rewards.mean())] * len(c) for r, c in zip(rewards, completions)]}
                 ).to_parquet(tmp_path / "batch.parquet")
    paths = dict(batch_parquet=str(tmp_path / "batch.parquet"), model_path=tiny, reference_model_path=tiny)
    out = {}
    for packed in (False, True):
        cfg = PolicyConfig(micro_batch_size=16, lr=1e-2, kl_loss_coef=0.1, pack_samples=packed)
        out[packed] = train_policy(cfg, out_dir=str(tmp_path / str(packed)), **paths)
    assert len(out[True]["loss_curve"]) == 3
    np.testing.assert_allclose(out[True]["loss_curve"], out[False]["loss_curve"], atol=1e-5)
    weights = {k: load_model_and_tokenizer(out[k]["model_dir"])[0].state_dict() for k in out}
    base = load_model_and_tokenizer(tiny)[0].state_dict()
    # Adam divides by the gradient's scale: a near-zero gradient's rounding can move its weight by a fraction of
    # lr, so the weights agree to a small share of the update rather than to float precision
    update = max((weights[False][k] - base[k]).abs().max().item() for k in base)
    gap = max((weights[True][k] - weights[False][k]).abs().max().item() for k in base)
    assert update > 1e-3 and gap < 0.02 * update, (gap, update)


def test_packed_scoring_pass_equals_padded(tiny):
    """The update's fixed log-probs (old policy, reference) through length-sorted scoring batches, packed."""
    from batchrl.training.data.batch_layout import sequence_token_logprobs

    model, _ = load_model_and_tokenizer(tiny)
    prompts, completions = _ragged(40, 4, model.config.vocab_size)
    rows = {"prompt_ids": prompts, "response_ids": completions}
    padded, packed = (sequence_token_logprobs(model, rows, 0, "cpu", temperature=0.7, max_tokens=300, packed=p)
                      for p in (False, True))
    assert [len(x) for x in packed] == list(map(len, completions))
    np.testing.assert_allclose(np.concatenate(packed), np.concatenate(padded), atol=2e-5)


def test_packing_is_refused_with_compiled_layers():
    with pytest.raises(ValueError, match="recompiles the layers"):
        PolicyConfig(pack_samples=True, torch_compile=True)
    assert PolicyConfig(pack_samples=True).pack_samples and PolicyConfig(torch_compile=True).torch_compile


def test_a_model_that_ignores_packed_positions_is_refused_before_training(tiny, tmp_path, monkeypatch):
    """Without transformers' packed-sequence mask (older versions; simulated by turning its detection off) packed
    rows would attend across sequences and train on wrong log-probs: the update refuses at its start."""
    import transformers.masking_utils as masking

    from batchrl.training.data.batch_layout import check_packing_supported

    model, _ = load_model_and_tokenizer(tiny)
    check_packing_supported(model, "cpu")  # the real path: accepted
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match="set pack_samples: false"):
        check_packing_supported(model, "cpu")
    prompts, completions = _ragged(8, 5, model.config.vocab_size)
    pd.DataFrame({"prompt_ids": prompts, "response_ids": completions,
                  "advantages": [[1.0] * len(c) for c in completions]}).to_parquet(tmp_path / "batch.parquet")
    with pytest.raises(ValueError, match="set pack_samples: false"):
        train_policy(PolicyConfig(micro_batch_size=4, kl_loss_coef=0.0, pack_samples=True), out_dir=str(tmp_path / "out"),
                     batch_parquet=str(tmp_path / "batch.parquet"), model_path=tiny)
