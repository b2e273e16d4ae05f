"""Masked reductions, whitening and loss aggregation shared by the RL math.

Every helper here treats ``mask == 0`` positions as absent: values there (even NaN/inf) never
reach a result, so right-padding a batch never changes anything computed from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def as_float(x: torch.Tensor) -> torch.Tensor:
    """Upcast half/bfloat16 to float32 (float32/float64 stay): the math below runs at >= fp32."""
    x = torch.as_tensor(x)
    if x.dtype in (torch.float16, torch.bfloat16) or not x.is_floating_point():
        return x.float()
    return x


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(x * mask), with masked-out entries replaced by 0 first (so NaN padding is harmless)."""
    zeroed = torch.where(mask.bool(), x * mask.to(x.dtype), torch.zeros_like(x))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """mean = sum(x * m) / max(sum(m), 1e-8)  (verl ``masked_mean``; an all-zero mask gives 0)."""
    denom = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / denom.clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries; unbiased uses Bessel's n/(n-1) (verl ``masked_var``).

    With a single valid entry the unbiased variance is undefined: we return the biased value 0
    instead of raising (verl raises), so whitening a one-token batch yields 0 advantages.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.to(x.dtype).sum()
    if n == 0:
        raise ValueError("masked_var: the mask selects no element")
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten over masked entries: (x - mean) / sqrt(var + 1e-8), unbiased var (verl convention).

    ``shift_mean=False`` adds the mean back (scale only). Masked-out positions of the output are
    not meaningful (callers multiply by the mask).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    safe_x = torch.where(mask.bool(), x, mean)
    whitened = (safe_x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *, norm_constant=None):
    """Aggregate a [B, T] per-token loss into a scalar (verl ``agg_loss`` modes).

    With m the mask, L the losses, S = {i : sum_t m_it > 0} (sequences with any valid token):

    - ``token-mean``:              sum_it m L / sum_it m
    - ``seq-mean-token-sum``:      mean_{i in S} sum_t m L
    - ``seq-mean-token-mean``:     mean_{i in S} (sum_t m L / sum_t m)
    - ``seq-mean-token-sum-norm``: (mean_{i in S} sum_t m L) / norm_constant  (Dr.GRPO: the
      per-sequence token sums averaged over the batch, then divided by a constant; norm_constant
      defaults to T = loss_mask.shape[-1], as verl — pass a fixed constant (e.g. the maximum
      response length) so that changing the padded length does not rescale the loss)

    As verl >= 0.9 (``agg_loss`` with ``dp_size=1`` and no global batch info), every seq-mean mode
    averages over S, the sequences with at least one valid token, so all-padding rows never dilute
    the loss. (verl before 0.9 summed ``seq-mean-token-sum-norm`` over the batch without the mean,
    which made the loss — and the effective learning rate — grow with the batch size.)
    """
    valid = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    seq_sum = masked_sum(loss_mat, loss_mask, dim=-1)
    tokens_per_seq = valid.sum(dim=-1)
    seq_present = tokens_per_seq > 0
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_mean(seq_sum, seq_present)
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(seq_sum / tokens_per_seq.clamp_min(1e-8), seq_present)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = loss_mask.shape[-1] if norm_constant is None else norm_constant
        return masked_mean(seq_sum, seq_present) / norm
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")


def group_ids(index, batch_size: int, device=None) -> torch.Tensor:
    """Map any array-like of hashable group ids (numpy object array, list, tensor) to a dense
    int64 tensor 0..G-1 in order of first appearance."""
    if isinstance(index, torch.Tensor):
        items: Sequence = index.tolist()
    elif hasattr(index, "tolist"):  # numpy arrays (object arrays of str included)
        items = index.tolist()
    else:
        items = list(index)
    if len(items) != batch_size:
        raise ValueError(f"index has {len(items)} entries but the batch has {batch_size}")
    dense: dict = {}
    return torch.tensor([dense.setdefault(k, len(dense)) for k in items], dtype=torch.long, device=device)


def group_mean_std(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group statistics (mean, unbiased std, size) broadcast back to [B].

    A group of one gets mean 0 and std 1 (verl convention: its score passes through unchanged).
    """
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, gid, scores)
    mean = sums / counts
    sq_dev = torch.zeros_like(counts).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq_dev / (counts - 1).clamp_min(1))
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid]
