"""The static-cache engine: its decoder equals the HF forward pass, greedy decoding equals plain
``generate``, sampling follows the distribution it claims, unsupported models fail with a clear error."""

import pytest
import torch
from transformers import (
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
    Qwen3ForCausalLM,
)

from batchrl.training.rollout import make_rollout_engine
from batchrl.training.rollout.static_cache import StaticKVDecoder, UnsupportedModelError
from batchrl.training.rollout.static_engine import sample_tokens, top_p_filter

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, head_dim=16)


@pytest.fixture(scope="module")
def model_path(arith_model):
    return arith_model


@pytest.mark.parametrize("model_cls,config_cls", [(Qwen2ForCausalLM, Qwen2Config), (LlamaForCausalLM, LlamaConfig),
                                                  (Qwen3ForCausalLM, Qwen3Config)])
@torch.no_grad()
def test_decoder_logits_equal_hf_forward(model_cls, config_cls):
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE)).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # ragged: left padding of 0, 3 and 2
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    decoder = StaticKVDecoder(model, batch=3, slots=64)
    logits = decoder.prefill(ids, torch.tensor([width - len(p) for p in prompts]))
    sequences = [list(p) for p in prompts]
    worst = 0.0
    for step in range(6):
        for row, seq in enumerate(sequences):
            reference = model(input_ids=torch.tensor([seq])).logits[0, -1]
            worst = max(worst, (reference - logits[row]).abs().max().item())
        next_tokens = torch.tensor([(3 * step + 7 * row) % 300 for row in range(3)])
        for row, seq in enumerate(sequences):
            seq.append(int(next_tokens[row]))
        logits = decoder.decode_step(next_tokens)
    assert worst < 1e-4


def test_greedy_equals_plain_generate(model_path):
    prompts = ["What is 1 + 2? Answer with a number.", "Compute 17 + 8.", "9 + 0 = ?", "12 + 30 = ?", "5 + 5"]
    plain = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=10, temperature=0.0, batch_size=3)
    static = make_rollout_engine("static", model_path=model_path, max_new_tokens=10, temperature=0.0, batch_size=3)
    a, b = plain.generate(prompts, n=2), static.generate(prompts, n=2)
    assert [s["response_ids"] for s in a] == [s["response_ids"] for s in b]
    assert [s["finish_reason"] for s in a] == [s["finish_reason"] for s in b]
    worst = max(abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa["rollout_logprobs"], sb["rollout_logprobs"]))
    assert worst < 1e-4


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(40_000, 1)
    tokens, logprobs = sample_tokens(logits, temperature=1.0, top_p=1.0)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.01)
    assert torch.allclose(logprobs, logits[0].log_softmax(-1)[tokens])
    hot, _ = sample_tokens(logits, temperature=0.5, top_p=1.0)
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / len(hot), (logits[0] / 0.5).softmax(-1), atol=0.01)
    greedy, _ = sample_tokens(logits[:3], temperature=0.0, top_p=1.0)
    assert greedy.tolist() == [0, 0, 0]


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)  # probs ~ .64 .24 .09 .03
    kept = torch.isfinite(top_p_filter(logits, 0.8))[0].tolist()
    assert kept == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.5))[0].tolist() == [True, False, False, False]
    tokens, _ = sample_tokens(logits.repeat(2000, 1), temperature=1.0, top_p=0.8)
    assert set(tokens.tolist()) == {0, 1}


def test_unsupported_architecture_is_refused_clearly(tmp_path, model_path):
    from batchrl.training.models.loading import load_tokenizer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*rollout engine 'transformers'"):
        make_rollout_engine("static", model=model, tokenizer=load_tokenizer(model_path))


def test_short_last_chunk_and_ragged_prompts(model_path):
    engine = make_rollout_engine("static", model_path=model_path, max_new_tokens=5, batch_size=4)
    prompts = ["1 + 1", "What is 11 + 22? Answer with a number, please.", "3 + 4 = ?"]
    samples = engine.generate(prompts, n=3, seed=1)  # 9 rows: chunks of 4, 4 and 1 (filled up to 4)
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(p, i) for p in range(3) for i in range(3)]
    assert samples == engine.generate(prompts, n=3, seed=1)
    assert len(engine._decoders) == 1  # every chunk fitted one cache shape: one decoder (one CUDA graph)
