"""The Triton LM-head log-prob kernels (the GPU path of ``token_logprobs_from_hidden``), run on CPU
in Triton's interpreter: same values and gradients as the naive float32 path. Collected by
``test_algos_triton.py`` in a fresh process (TRITON_INTERPRET must be set before triton is imported)."""
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_algos_triton.py"

from batchrl.training.algos import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from batchrl.training.algos import triton_logprobs


def naive(h, w, y, temperature, dtype):
    """Reference: logits in the inputs' dtype (as the LM head), softmax math in float32."""
    z = (h @ w.t()).to(dtype).float() / temperature
    return token_logprobs_from_logits(z, y), entropy_from_logits(z)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_match_naive(dtype, tol, with_entropy):
    assert triton_logprobs.available(torch.zeros(1))
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 16, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(300, 16, generator=gen) / 4).to(dtype).requires_grad_()
    y = torch.randint(0, 300, (3, 5), generator=gen)
    y[0, 1] = -100  # masked: log-prob 0, no gradient
    g_lp, g_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    # chunk 4 < 15 rows: several chunks, the weight gradient summed across them
    out = token_logprobs_from_hidden(h, w, y, chunk_size=4, temperature=0.7, with_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    loss = (lp * g_lp).sum() + ((ent * g_h).sum() if with_entropy else 0)
    grads = torch.autograd.grad(loss, (h, w))

    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    lp_ref, ent_ref = naive(h32, w32, y, 0.7, dtype)
    loss_ref = (lp_ref * g_lp).sum() + ((ent_ref * g_h).sum() if with_entropy else 0)
    grads_ref = torch.autograd.grad(loss_ref, (h32, w32))

    assert lp.dtype == torch.float32 and float(lp[0, 1]) == 0.0
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    if with_entropy:
        assert torch.allclose(ent, ent_ref, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype
        assert float((got.float() - want).norm() / want.norm()) < tol
    if not with_entropy:  # the masked token's log-prob sends nothing back (its entropy still does)
        assert float(grads[0][0, 1].abs().sum()) == 0.0


def test_one_chunk_and_single_block_vocab():
    """All rows in one chunk (weight gradient from one matmul) and a vocabulary under one block."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(6, 8, generator=gen, requires_grad=True)
    w = torch.randn(37, 8, generator=gen, requires_grad=True)
    y = torch.randint(0, 37, (6,), generator=gen)
    lp = token_logprobs_from_hidden(h, w, y, chunk_size=64)
    lp.sum().backward()
    ref = torch.log_softmax(h.detach() @ w.detach().t(), -1).gather(-1, y[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-5)
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    torch.log_softmax(h2 @ w2.t(), -1).gather(-1, y[:, None]).sum().backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-5)


def test_kernels_reject_bad_shapes():
    with pytest.raises(ValueError, match="labels"):
        triton_logprobs.forward_rows(torch.zeros(4, 10), torch.zeros(3, dtype=torch.long), 1.0, False)
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_logprobs.forward_rows(torch.zeros(10, 4).t(), torch.zeros(4, dtype=torch.long), 1.0, False)
