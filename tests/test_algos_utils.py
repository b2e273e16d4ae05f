"""Masked reductions, whitening, loss aggregation, group ids, import hygiene of training.algos."""

import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

from batchrl.training.algos import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten
from batchrl.training.algos.utils import group_ids, group_mean_std

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_mean_ignores_nan_padding():
    x = torch.tensor([[1.0, 3.0, float("nan")]])
    m = torch.tensor([[1, 1, 0]])
    assert masked_mean(x, m).item() == 2.0
    assert torch.equal(masked_mean(x, m, dim=-1), torch.tensor([2.0]))
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_var_and_whiten_match_hand_values():
    x = torch.tensor([[0.25, 0.5, 1.0, 99.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    values = [0.25, 0.5, 1.0]
    assert masked_var(x, m).item() == pytest.approx(statistics.variance(values), rel=1e-6)
    expected = [(v - statistics.mean(values)) / statistics.stdev(values) for v in values]
    assert masked_whiten(x, m)[0, :3].tolist() == pytest.approx(expected, rel=1e-5)
    unshifted = masked_whiten(x, m, shift_mean=False)[0, :3]
    assert unshifted.tolist() == pytest.approx([e + statistics.mean(values) for e in expected], rel=1e-5)


def test_whiten_single_valid_token_gives_zero_not_nan():
    out = masked_whiten(torch.tensor([[3.0, 7.0]]), torch.tensor([[1, 0]]))
    assert out[0, 0].item() == 0.0


@pytest.mark.parametrize(
    "mode,expected",
    [("token-mean", 10 / 4), ("seq-mean-token-sum", (6 + 4) / 2), ("seq-mean-token-mean", (2 + 4) / 2),
     ("seq-mean-token-sum-norm", (6 + 4) / 2 / 3)],
)
def test_agg_loss_hand_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_norm_constant():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=5).item() == pytest.approx(1.0)


def _verl_agg_loss(loss_mat, loss_mask, mode):
    """verl 0.9's ``agg_loss`` at dp_size=1 with no global batch info, written out row by row:
    token sums of the sequences with a valid token, averaged; Dr.GRPO divides by the horizon T."""
    rows = [(sum(l * m for l, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss_mat.tolist(), loss_mask.tolist())]
    present = [(total, n) for total, n in rows if n > 0]
    if mode == "token-mean":
        return sum(t for t, _ in present) / sum(n for _, n in present)
    if mode == "seq-mean-token-mean":
        return sum(t / n for t, n in present) / len(present)
    seq_mean = sum(t for t, _ in present) / len(present)
    return seq_mean / loss_mask.shape[-1] if mode == "seq-mean-token-sum-norm" else seq_mean


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_verl_on_a_12_by_9_batch(mode):
    g = torch.Generator().manual_seed(12)
    loss = torch.randn(12, 9, generator=g, dtype=torch.float64) * 1e-3
    lengths = torch.randint(0, 10, (12,), generator=g)
    lengths[3] = 0  # an all-padding row
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    assert agg_loss(loss, mask, mode).item() == pytest.approx(_verl_agg_loss(loss, mask, mode), rel=1e-12)


def test_seq_mean_token_sum_norm_does_not_grow_with_the_batch():
    doubled = agg_loss(torch.cat([LOSS, LOSS]), torch.cat([MASK, MASK]), "seq-mean-token-sum-norm")
    assert doubled.item() == pytest.approx(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_padding_rows_and_columns_do_not_change_result(mode):
    padded_loss = torch.cat([LOSS, torch.full((1, 3), float("nan"))])
    padded_loss = torch.cat([padded_loss, torch.full((3, 2), float("inf"))], dim=1)
    padded_mask = torch.zeros(3, 5, dtype=MASK.dtype)
    padded_mask[:2, :3] = MASK
    ref = agg_loss(LOSS, MASK, mode, norm_constant=3)
    assert agg_loss(padded_loss, padded_mask, mode, norm_constant=3).item() == pytest.approx(ref.item())


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_gradcheck(mode):
    loss = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]])
    assert torch.autograd.gradcheck(lambda x: agg_loss(x, mask, mode), (loss,))


@pytest.mark.parametrize(
    "index", [np.array(["p1", "p2", "p1"], dtype=object), ["p1", "p2", "p1"], torch.tensor([7, 3, 7]), (None, 1.5, None)]
)
def test_group_ids_accept_any_hashables(index):
    assert group_ids(index, 3).tolist() == [0, 1, 0]


def test_group_ids_length_mismatch():
    with pytest.raises(ValueError, match="index has 2"):
        group_ids([0, 1], 3)


def test_group_mean_std_unbiased_and_singletons():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mean, std, count = group_mean_std(scores, torch.tensor([0, 0, 0, 1]))
    assert mean.tolist() == pytest.approx([2.0, 2.0, 2.0, 0.0])
    assert std.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert count.tolist() == [3, 3, 3, 1]


def test_algos_import_only_torch():
    code = (
        "import sys, batchrl.training\n"
        "before = set(sys.modules)\n"
        "import batchrl.training.algos\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "bad = sorted(new & {'dagster', 'deepspeed', 'vllm', 'transformers', 'pandas'})\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
