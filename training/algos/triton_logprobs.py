"""Triton row kernels for the chunked LM-head log-probs (``logprobs.token_logprobs_from_hidden``).

The matmuls stay in cuBLAS; these kernels replace the float32 passes over a ``[rows, V]`` logits
chunk (upcast, max, exp, sum, gather, and in backward softmax and the one-hot scatter) with one
read in forward and one read + one in-place write in backward, in the logits' own dtype (bf16 on
GPUs). Each program owns one row and walks the vocabulary in blocks with an online softmax:

    m' = max(m, max_b z),  s' = s e^(m - m') + sum_b e^(z - m'),  t' = t e^(m - m') + sum_b e^(z - m') z
    lse = m + log s,  H = lse - t / s,  logp = z_y - lse            (z = logits / tau)

Backward writes dL/dz = g_lp (onehot(y) - p) - g_H p (z - E_p[z]),  p = e^(z - lse), E_p[z] = lse - H,
divided by tau, over the logits buffer. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors
(the tests do). Triton is imported lazily: the rest of ``algos`` needs torch alone.
"""
from __future__ import annotations

import functools
import os

import torch

BLOCK = 4096  # vocabulary columns per loop iteration


def available(tensor: torch.Tensor) -> bool:
    """Triton kernels can run on ``tensor``: CUDA with triton installed, or the CPU interpreter."""
    if not (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward_rows(logits_ptr, stride, labels_ptr, lse_ptr, target_ptr, entropy_ptr, inv_tau,
                     V: tl.constexpr, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        m = tl.full((), -float("inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        t = tl.full((), 0.0, tl.float32)
        for start in tl.range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_tau
            new_m = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - new_m)
            e = tl.exp(z - new_m)
            s = s * scale + tl.sum(e, 0)
            if WITH_ENTROPY:
                t = t * scale + tl.sum(e * tl.where(cols < V, z, 0.0), 0)
            m = new_m
        lse = m + tl.log(s)
        label = tl.load(labels_ptr + row)
        target = tl.load(base + label).to(tl.float32) * inv_tau
        tl.store(lse_ptr + row, lse)
        tl.store(target_ptr + row, target)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, lse - t / s)

    @triton.jit
    def backward_rows(logits_ptr, stride, labels_ptr, lse_ptr, entropy_ptr, grad_lp_ptr, grad_h_ptr, inv_tau,
                      V: tl.constexpr, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        lse = tl.load(lse_ptr + row)
        g_lp = tl.load(grad_lp_ptr + row)
        label = tl.load(labels_ptr + row)
        if WITH_ENTROPY:
            g_h = tl.load(grad_h_ptr + row)
            expected = lse - tl.load(entropy_ptr + row)
        for start in tl.range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inside = cols < V
            z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) * inv_tau
            p = tl.exp(z - lse)
            if WITH_ENTROPY:
                grad = -p * (g_lp + g_h * (z - expected))
            else:
                grad = -p * g_lp
            grad = tl.where(cols == label, grad + g_lp, grad) * inv_tau
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)

    return forward_rows, backward_rows


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be a [rows, V] tensor with contiguous rows")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits rows {logits.shape[0]}")


def forward_rows(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """Per row of ``logits`` [n, V] (any float dtype): ``(lse, target, entropy)`` in float32 of
    z = logits / tau; ``labels`` must be valid ids (clamp masked ones before)."""
    _check(logits, labels)
    n, vocab = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    target = torch.empty_like(lse)
    entropy = torch.empty(n if with_entropy else 1, dtype=torch.float32, device=logits.device)
    if n:
        _kernels()[0][(n,)](logits, logits.stride(0), labels, lse, target, entropy, 1.0 / temperature,
                            V=vocab, BLOCK_V=min(BLOCK, _pow2(vocab)), WITH_ENTROPY=with_entropy)
    return lse, target, entropy[:n] if with_entropy else None


def backward_rows_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_logprobs: torch.Tensor,
                   temperature: float, entropy: torch.Tensor | None = None,
                   grad_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite ``logits`` [n, V] with dL/d(logits) (see the module docstring) and return it.
    ``grad_logprobs`` must already be 0 on rows whose label is masked."""
    _check(logits, labels)
    n, vocab = logits.shape
    with_entropy = grad_entropy is not None
    if n:
        _kernels()[1][(n,)](logits, logits.stride(0), labels, lse, entropy if with_entropy else lse,
                            grad_logprobs.to(torch.float32).contiguous(),
                            grad_entropy.to(torch.float32).contiguous() if with_entropy else lse,
                            1.0 / temperature, V=vocab, BLOCK_V=min(BLOCK, _pow2(vocab)),
                            WITH_ENTROPY=with_entropy)
    return logits


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
