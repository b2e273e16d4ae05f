"""Token log-probs and entropy: a naive reference from logits, and a chunked LM-head path.

The chunked path never builds the full [B, T, V] float32 logits: rows (tokens) are processed
``chunk_size`` at a time, in forward *and* backward (a custom autograd Function that saves only
the inputs and one log-sum-exp per token, and recomputes each chunk's logits in backward).
Peak extra memory is O(chunk_size * V) instead of O(B * T * V).

Numerics (both paths): logits are produced in the inputs' dtype (as the model's LM head would),
then upcast to float32 before temperature scaling, log-softmax and entropy; results are
float32 (float64 for float64 inputs). Labels < 0 (e.g. -100 padding) give log-prob 0 and no
gradient.
"""

from __future__ import annotations

import torch

from batchrl.training.algos import triton_logprobs


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_logprobs_from_logits(logits, labels):
    """Naive reference: log softmax(logits)[label] in float32, [B, T, V] x [B, T] -> [B, T].

    Materialises full-vocabulary float32 tensors; use ``token_logprobs_from_hidden`` in training.
    """
    valid = labels >= 0
    logp = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1)
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def entropy_from_logits(logits):
    """Entropy of softmax(logits) over the last dim, float32: H = logsumexp(z) - sum_v p_v z_v
    (verl ``entropy_from_logits``)."""
    z = logits.to(_compute_dtype(logits.dtype))
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


class _ChunkBuffers:
    """Reusable [chunk_size, V] work buffers: allocating a fresh ~100 MB tensor per chunk makes
    the allocator hand pages back and fault them in again, which costs more than the math on CPU."""

    def __init__(self, hidden, weight, chunk_size, n_compute):
        rows = min(chunk_size, hidden.shape[0])
        self.compute_dtype = _compute_dtype(hidden.dtype)
        shape = (rows, weight.shape[0])
        self.compute = [torch.empty(shape, dtype=self.compute_dtype, device=hidden.device) for _ in range(n_compute)]
        self.low = None if hidden.dtype == self.compute_dtype else torch.empty(shape, dtype=hidden.dtype, device=hidden.device)

    def logits(self, hidden_chunk, weight, temperature):
        """z = (h W^T) / tau in the compute dtype, written into the first buffer."""
        n = hidden_chunk.shape[0]
        out = self.compute[0][:n]
        if self.low is None:
            torch.matmul(hidden_chunk, weight.t(), out=out)
        else:  # matmul in the model dtype (as the LM head would), softmax math in float32
            out.copy_(torch.matmul(hidden_chunk, weight.t(), out=self.low[:n]))
        if temperature != 1.0:
            out.div_(temperature)
        return out


class _ChunkedLMHeadLogProbs(torch.autograd.Function):
    """logp_n = z_n[y_n] - lse(z_n), H_n = lse(z_n) - sum_v p_nv z_nv, z_n = (h_n W^T) / tau.

    Backward per chunk: dL/dz = g_lp (onehot(y) - p) - g_H p (z - E_p[z]); then
    dL/dh = (dL/dz / tau) W and dL/dW = sum_chunks (dL/dz / tau)^T h, accumulated in float32
    in place (no [V, H] temporary per chunk).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, temperature, with_entropy):
        ctx.set_materialize_grads(False)
        n_rows = hidden.shape[0]
        valid = labels >= 0
        safe_labels = labels.clamp_min(0)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy = chunk_size, temperature, with_entropy
        ctx.triton = triton_logprobs.available(hidden)
        if ctx.triton:
            logprobs, lse, entropy = _triton_forward(hidden, weight, safe_labels, chunk_size, temperature, with_entropy)
            logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
            ctx.save_for_backward(hidden, weight, safe_labels, valid, lse, entropy)
            if not with_entropy:
                ctx.mark_non_differentiable(entropy)
            return logprobs, entropy
        buffers = _ChunkBuffers(hidden, weight, chunk_size, 2 if with_entropy else 1)
        logprobs = torch.empty(n_rows, dtype=buffers.compute_dtype, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty(n_rows if with_entropy else 0, dtype=buffers.compute_dtype, device=hidden.device)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            logits = buffers.logits(hidden[rows], weight, temperature)
            target = logits.gather(-1, safe_labels[rows].unsqueeze(-1)).squeeze(-1)
            row_max = logits.amax(dim=-1, keepdim=True)
            shifted = logits.sub_(row_max)  # z - m, in place
            if with_entropy:
                unnormalised = torch.exp(shifted, out=buffers.compute[1][: shifted.shape[0]])
                sum_exp = unnormalised.sum(dim=-1)
                # H = log S - sum_v e^(z_v - m) (z_v - m) / S, with S = sum_v e^(z_v - m)
                entropy[rows] = sum_exp.log() - torch.linalg.vecdot(unnormalised, shifted) / sum_exp
            else:
                sum_exp = shifted.exp_().sum(dim=-1)
            lse[rows] = sum_exp.log() + row_max.squeeze(-1)
            logprobs[rows] = target - lse[rows]
        logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
        ctx.save_for_backward(hidden, weight, safe_labels, valid, lse, entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, valid, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if grad_logprobs is None and not use_entropy:
            return None, None, None, None, None, None
        work_dtype = lse.dtype
        grad_logprobs = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(work_dtype)
        grad_logprobs = torch.where(valid, grad_logprobs, torch.zeros_like(lse))
        if ctx.triton:
            return (*_triton_backward(ctx, hidden, weight, labels, lse, entropy, grad_logprobs,
                                      grad_entropy if use_entropy else None), None, None, None, None)
        buffers = _ChunkBuffers(hidden, weight, ctx.chunk_size, 2 if use_entropy else 1)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=work_dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
            logits = buffers.logits(hidden[rows], weight, ctx.temperature)
            g_lp = grad_logprobs[rows].unsqueeze(-1)
            row_lse = lse[rows].unsqueeze(-1)
            if use_entropy:
                probs = torch.sub(logits, row_lse, out=buffers.compute[1][: logits.shape[0]]).exp_()
                expected_logit = row_lse - entropy[rows].unsqueeze(-1)  # E_p[z] = lse - H
                coef = logits.sub_(expected_logit).mul_(-grad_entropy[rows].to(work_dtype).unsqueeze(-1)).sub_(g_lp)
                grad_logits = probs.mul_(coef)  # -p (g_lp + g_H (z - E_p[z]))
            else:
                grad_logits = logits.sub_(row_lse).exp_().mul_(-g_lp)  # -p g_lp
            grad_logits.scatter_add_(-1, labels[rows].unsqueeze(-1), g_lp)
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            if need_hidden:
                low = grad_logits if buffers.low is None else buffers.low[: grad_logits.shape[0]].copy_(grad_logits)
                torch.matmul(low, weight, out=grad_hidden[rows])
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), hidden[rows].to(work_dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _triton_forward(hidden, weight, labels, chunk_size, temperature, with_entropy):
    """Forward on GPUs: each chunk's logits from one cuBLAS matmul in the inputs' dtype, then one
    Triton pass per row for log-sum-exp, the label's logit and (optionally) entropy."""
    n_rows = hidden.shape[0]
    lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    target = torch.empty_like(lse)
    entropy = torch.empty(n_rows if with_entropy else 0, dtype=torch.float32, device=hidden.device)
    buffer = torch.empty((min(chunk_size, n_rows), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk_size):
        rows = slice(start, min(start + chunk_size, n_rows))
        logits = torch.matmul(hidden[rows], weight.t(), out=buffer[: rows.stop - start])
        lse[rows], target[rows], ent = triton_logprobs.forward_rows(logits, labels[rows], temperature, with_entropy)
        if with_entropy:
            entropy[rows] = ent
    return target - lse, lse, entropy


def _triton_backward(ctx, hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy):
    """Backward on GPUs: recompute each chunk's logits, overwrite them with dL/dz in one Triton pass,
    then two cuBLAS matmuls in the inputs' dtype; the weight gradient of several chunks is summed
    in float32."""
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    n_rows, chunk = hidden.shape[0], ctx.chunk_size
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = None
    buffer = torch.empty((min(chunk, n_rows), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        logits = torch.matmul(hidden[rows], weight.t(), out=buffer[: rows.stop - start])
        grad_logits = triton_logprobs.backward_rows_(
            logits, labels[rows], lse[rows], grad_logprobs[rows], ctx.temperature,
            entropy[rows] if grad_entropy is not None else None,
            grad_entropy[rows] if grad_entropy is not None else None)
        if need_hidden:
            torch.matmul(grad_logits, weight, out=grad_hidden[rows])
        if need_weight:
            part = grad_logits.t() @ hidden[rows]
            if n_rows <= chunk:
                grad_weight = part
            elif grad_weight is None:
                grad_weight = part.float()
            else:
                grad_weight += part
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight


def token_logprobs_from_hidden(
    hidden, lm_head_weight, labels, *, chunk_size=1024, temperature=1.0, with_entropy=False
):
    """Token log-probs log softmax(h W^T / tau)[label] without a full [B, T, V] logits tensor.

    hidden [B, T, H] (or [N, H]), lm_head_weight [V, H], labels [B, T] -> float32 [B, T]
    (float64 for float64 inputs); with ``with_entropy`` also returns the softmax entropy [B, T].
    Equal to ``token_logprobs_from_logits(hidden @ W.T / tau, labels)`` up to float32 rounding;
    bf16 inputs give the float32-accurate log-softmax of the bf16 logits, which is what the
    naive path computes from the model's bf16 logits. Differentiable w.r.t. ``hidden`` and
    ``lm_head_weight`` (first order; backward is chunked too). ``chunk_size`` counts tokens
    (rows of the flattened batch): peak extra memory ~ 2 * chunk_size * V * 4 bytes (3 with entropy)
    plus, in backward, a float32 [V, H] gradient accumulator.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be > 0")
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but lm_head_weight is {lm_head_weight.dtype}")
    lead_shape = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(torch.long)
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"hidden has {flat_hidden.shape[0]} rows, labels {flat_labels.shape[0]}")
    logprobs, entropy = _ChunkedLMHeadLogProbs.apply(
        flat_hidden, lm_head_weight, flat_labels, int(chunk_size), float(temperature), bool(with_entropy)
    )
    if with_entropy:
        return logprobs.reshape(lead_shape), entropy.reshape(lead_shape)
    return logprobs.reshape(lead_shape)
