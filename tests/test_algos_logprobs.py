"""Naive and chunked token log-probs / entropy: values, gradients, dtypes, memory shape."""

import pytest
import torch

from batchrl.training.algos import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits


def make_inputs(batch=2, seq=9, hidden=16, vocab=300, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[1, -3:] = -100  # padding labels
    return h, w, labels


def test_naive_hand_values():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[3, -100]])
    assert token_logprobs_from_logits(logits, labels)[0].tolist() == pytest.approx([-1.3862944, 0.0])
    ent = entropy_from_logits(logits)[0]
    p = torch.softmax(logits[0, 1], 0)
    assert ent.tolist() == pytest.approx([1.3862944, float(-(p * p.log()).sum())], rel=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 5, 18, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_matches_naive(chunk_size, temperature):
    h, w, labels = make_inputs()
    logits = (h @ w.t()) / temperature
    lp, ent = token_logprobs_from_hidden(h, w, labels, chunk_size=chunk_size, temperature=temperature,
                                         with_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    assert torch.allclose(lp, token_logprobs_from_logits(logits, labels), atol=1e-5, rtol=0)
    assert torch.allclose(ent, entropy_from_logits(logits), atol=1e-5, rtol=0)
    assert torch.all(lp[1, -3:] == 0)
    only_lp = token_logprobs_from_hidden(h, w, labels, chunk_size=chunk_size, temperature=temperature)
    assert torch.equal(only_lp, lp)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_gradients_match_naive(with_entropy):
    h, w, labels = make_inputs()
    g = torch.Generator().manual_seed(1)
    coef_lp, coef_ent = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)

    def objective(fn_out):
        lp, ent = fn_out
        return (coef_lp * lp).sum() + ((coef_ent * ent).sum() if with_entropy else 0)

    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    objective(token_logprobs_from_hidden(h1, w1, labels, chunk_size=4, temperature=0.8, with_entropy=True)).backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logits = (h2 @ w2.t()) / 0.8
    objective((token_logprobs_from_logits(logits, labels), entropy_from_logits(logits))).backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_gradcheck_float64(with_entropy):
    h, w, labels = make_inputs(batch=2, seq=3, hidden=5, vocab=7, dtype=torch.float64)
    labels[0, 1] = -100
    h.requires_grad_(True), w.requires_grad_(True)

    def fn(h, w):
        return token_logprobs_from_hidden(h, w, labels, chunk_size=2, temperature=0.7, with_entropy=with_entropy)

    assert torch.autograd.gradcheck(fn, (h, w))


def test_gradient_only_for_hidden():
    h, w, labels = make_inputs()
    h.requires_grad_(True)
    token_logprobs_from_hidden(h, w, labels, chunk_size=7).sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all() and w.grad is None


def test_bf16_inputs_give_float32_log_softmax_of_bf16_logits():
    h, w, labels = make_inputs(dtype=torch.bfloat16, vocab=1000)
    lp = token_logprobs_from_hidden(h, w, labels, chunk_size=6)
    reference = token_logprobs_from_logits(h @ w.t(), labels)  # the model's bf16 logits, fp32 softmax
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, reference, atol=1e-5, rtol=0)
    exact = token_logprobs_from_logits(h.double() @ w.double().t(), labels)
    assert (lp.double() - exact).abs().max() < 0.1  # bf16 logits rounding only, no bf16 softmax


def test_bf16_backward_runs_and_matches_dtype():
    h, w, labels = make_inputs(dtype=torch.bfloat16)
    h.requires_grad_(True), w.requires_grad_(True)
    token_logprobs_from_hidden(h, w, labels, chunk_size=5).sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_autograd_saves_no_full_vocab_tensor():
    h, w, labels = make_inputs(batch=4, seq=32, vocab=2000)
    h.requires_grad_(True), w.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp, ent = token_logprobs_from_hidden(h, w, labels, chunk_size=16, with_entropy=True)
    full_logits = labels.numel() * w.shape[0]
    assert sum(saved) < full_logits / 4  # only inputs + per-token statistics are kept
    (lp.sum() + ent.sum()).backward()


def test_argument_validation():
    h, w, labels = make_inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_from_hidden(h, w, labels, chunk_size=0)
    with pytest.raises(ValueError, match="rows"):
        token_logprobs_from_hidden(h, w, labels[:, :-1])
    with pytest.raises(ValueError, match="lm_head_weight is torch.bfloat16"):
        token_logprobs_from_hidden(h, w.bfloat16(), labels)


def test_naive_paths_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 5, -100], [2, 2, 1]])
    assert torch.autograd.gradcheck(lambda z: token_logprobs_from_logits(z, labels), (logits,))
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))


def test_entropy_only_objective_backpropagates():
    h, w, labels = make_inputs()
    h1 = h.clone().requires_grad_(True)
    _, ent = token_logprobs_from_hidden(h1, w, labels, chunk_size=5, with_entropy=True)
    ent.sum().backward()
    h2 = h.clone().requires_grad_(True)
    entropy_from_logits(h2 @ w.t()).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
