"""DAPO's batch shaping (Yu et al. 2025, arXiv:2503.14476; verl's ``recipe/dapo``): the soft overlong
punishment added to the sequence reward, overlong filtering (truncated samples out of the loss) and dynamic
sampling (groups whose rewards are all identical leave the batch).

Pure torch, ``[B]`` per-sample tensors (``[B, T]`` masks); each function states its formula.
"""

from __future__ import annotations

import torch

from .utils import group_ids


def compute_overlong_penalty(response_length: torch.Tensor, *, max_response_length: int, buffer_length: int,
                             penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), scaled by ``penalty_factor`` as verl's ``overlong_buffer``.

    With ``L_max = max_response_length``, ``L_cache = buffer_length`` and ``|y|`` the response length::

        R_length(y) = 0                                   if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                    = -1                                  if |y| > L_max

    returned as ``penalty_factor * R_length(y)`` (float32, ``<= 0``): the penalty grows linearly through the
    buffer, so a response is told it is getting long before it is cut. (verl computes the middle branch
    only, ``min(-exceed / L_cache * factor, 0)``, its responses never exceeding ``L_max``; here the -1 cap
    keeps the formula's last branch for lengths counted past the limit, e.g. a trajectory's observations.)
    """
    if not 0 < buffer_length < max_response_length:
        raise ValueError(f"overlong buffer length {buffer_length} must be in (0, max response length "
                         f"{max_response_length})")
    expected = max_response_length - buffer_length
    exceed = torch.as_tensor(response_length, dtype=torch.float32) - expected
    return -penalty_factor * (exceed / buffer_length).clamp(min=0.0, max=1.0)


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: ``m'_it = m_it * (1 - truncated_i)``. A response cut at the token limit
    has no end of its own, so its reward says little about it; its tokens leave the policy loss (an all-zero
    row, which ``agg_loss`` counts in no denominator) while it still counts in its group's statistics."""
    keep = (~torch.as_tensor(truncated, dtype=torch.bool, device=response_mask.device)).to(response_mask.dtype)
    return response_mask * keep.unsqueeze(-1)


def dynamic_sampling_keep(scores: torch.Tensor, index) -> torch.Tensor:
    """DAPO's dynamic sampling filter (verl ``filter_groups``): ``keep_i = std_g(i) > 0 or |g(i)| = 1``.

    A group (``index``: its prompt) whose sequence rewards are all identical has zero group-relative
    advantage, so it adds no policy gradient, only dilutes the batch; it is dropped. A group of one is
    kept, as verl does (no spread to judge). Returns a ``[B]`` bool tensor."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    gid = group_ids(index, scores.shape[0], device=scores.device)
    if not gid.numel():
        return torch.zeros(0, dtype=torch.bool, device=scores.device)
    n_groups = int(gid.max()) + 1
    # exact comparison, as std > 0 is: identical floats give max == min
    high = torch.full((n_groups,), -torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, gid, scores, reduce="amax")
    low = torch.full((n_groups,), torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, gid, scores, reduce="amin")
    size = torch.zeros(n_groups, dtype=torch.long, device=scores.device).index_add_(0, gid, torch.ones_like(gid))
    return ((high > low) | (size == 1))[gid]
