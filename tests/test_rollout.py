
import pytest
import torch

from batchrl.training.rollout import (
    RolloutEngine,
    TransformersRolloutEngine,
    VLLMUnavailableError,
    make_rollout_engine,
)

PROMPTS = ["What is 1 + 2? Answer with a number.", "Compute 7 + 8. Answer with a number.", "9 + 0 = ?"]


@pytest.fixture(scope="module")
def model_path(arith_model):
    return arith_model


def _vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vLLM is not installed here (GPU extra); its run of this contract is recorded in bench/RESULTS.md")


ENGINE_OPTIONS = {"transformers": {"batch_size": 4}, "static": {"batch_size": 4},
                  "vllm": {"gpu_memory_utilization": 0.3, "sampled_logprobs": True}}


@pytest.fixture(scope="module", params=sorted(ENGINE_OPTIONS))
def engine(request, model_path):
    """The one engine contract, run by every backend (vLLM wherever it is importable)."""
    if request.param == "vllm":
        _vllm_or_skip()
    return make_rollout_engine(request.param, model_path=model_path, max_new_tokens=8, **ENGINE_OPTIONS[request.param])


def test_shape_and_fields(engine):
    assert isinstance(engine, RolloutEngine)
    samples = engine.generate(PROMPTS, n=3, seed=0)
    assert len(samples) == 9
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(p, i) for p in range(3) for i in range(3)]
    eos = engine.tokenizer.eos_token_id
    for s in samples:
        assert s["prompt"] == PROMPTS[s["prompt_index"]]
        assert 1 <= len(s["response_ids"]) <= 8
        assert len(s["rollout_logprobs"]) == len(s["response_ids"])
        assert all(lp <= 0 for lp in s["rollout_logprobs"])
        if s["finish_reason"] == "stop":
            assert s["response_ids"][-1] == eos and eos not in s["response_ids"][:-1]
        else:
            assert s["finish_reason"] == "length" and len(s["response_ids"]) == 8 and eos not in s["response_ids"]
        assert s["response"] == engine.tokenizer.decode(s["response_ids"], skip_special_tokens=True)
    # samples of one prompt differ (random weights, temperature 1)
    assert len({tuple(s["response_ids"]) for s in samples[:3]}) > 1


def test_deterministic_for_seed_and_rng_untouched(engine):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, n=2, seed=7)
    after = torch.rand(1)
    assert torch.equal(before, after)  # the caller's RNG stream is not consumed
    b = engine.generate(PROMPTS, n=2, seed=7)
    c = engine.generate(PROMPTS, n=2, seed=8)
    assert a == b
    assert [s["response_ids"] for s in a] != [s["response_ids"] for s in c]


@torch.no_grad()
def test_rollout_logprobs_match_forward_pass(engine, model_path):
    from batchrl.training.models.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(model_path)
    samples = engine.generate(PROMPTS, n=4, seed=3)
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        logits = model(input_ids=ids).logits[0].float()
        start = len(s["prompt_ids"])
        logps = torch.log_softmax(logits[start - 1 : -1], dim=-1)
        recomputed = logps.gather(-1, torch.tensor(s["response_ids"]).unsqueeze(-1)).squeeze(-1)
        worst = max(worst, (recomputed - torch.tensor(s["rollout_logprobs"])).abs().max().item())
    assert worst < 1e-4


@pytest.mark.parametrize("kind", ["transformers", "static"])
def test_greedy_is_seed_independent(kind, model_path):
    greedy = make_rollout_engine(kind, model_path=model_path, max_new_tokens=6, temperature=0.0, batch_size=2)
    a = greedy.generate(PROMPTS, n=1, seed=0)
    b = greedy.generate(PROMPTS, n=1, seed=99)
    assert [s["response_ids"] for s in a] == [s["response_ids"] for s in b]


def test_unknown_engine_and_missing_vllm(model_path):
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_rollout_engine("nope", model_path=model_path)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(VLLMUnavailableError, match="batchrl\\[gpu\\]") as info:
            make_rollout_engine("vllm", model_path=model_path)
        assert isinstance(info.value, ImportError)
    else:
        pytest.skip("vllm is installed here; the missing-vllm message cannot be exercised")


@pytest.mark.parametrize("kind", ["transformers", "static"])
def test_in_memory_model_matches_path_and_keeps_train_mode(kind, model_path):
    from batchrl.training.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_path)
    model.train()
    in_memory = make_rollout_engine(kind, model=model, tokenizer=tokenizer, max_new_tokens=8, batch_size=4)
    from_path = make_rollout_engine(kind, model_path=model_path, max_new_tokens=8, batch_size=4)
    assert in_memory.generate(PROMPTS, n=2, seed=5) == from_path.generate(PROMPTS, n=2, seed=5)
    assert model.training


def test_kept_logits_fit_their_budget_and_evaluation_keeps_none(model_path, monkeypatch):
    """``generate`` keeps every step's fp32 logits of a chunk: a real vocabulary at 512 tokens is ~311 MB a row, so
    32 rows OOM'd a 24 GB host. Chunks are cut to the budget (same samples per chunk seed, bounded memory); a
    greedy engine without log-probs (evaluation's) asks for no logits and keeps its batch."""
    import batchrl.training.rollout.transformers_engine as module

    full = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=8, batch_size=4)
    vocab = full.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(module, "LOGITS_BUDGET_BYTES", 2 * 8 * vocab * 4)  # room for two rows of 8 tokens
    cut = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=8, batch_size=4)
    assert cut.batch_size == 2
    one_row = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=64, batch_size=4)
    assert one_row.batch_size == 1  # never below one row
    static = make_rollout_engine("static", model_path=model_path, max_new_tokens=8, batch_size=4)
    assert static.batch_size == 4  # its decode loop keeps the sampled tokens' log-probs only
    static_quiet = make_rollout_engine("static", model_path=model_path, max_new_tokens=8, temperature=0.0,
                                       batch_size=4, sampled_logprobs=False)
    assert all(s["rollout_logprobs"] == [] for s in static_quiet.generate(PROMPTS, n=1))
    greedy_cut = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=8, temperature=0.0,
                                     batch_size=4)
    quiet = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=8, temperature=0.0,
                                batch_size=4, sampled_logprobs=False)
    assert (greedy_cut.batch_size, quiet.batch_size) == (2, 4)
    kept, answered = greedy_cut.generate(PROMPTS, n=1), quiet.generate(PROMPTS, n=1)
    assert [s["response_ids"] for s in answered] == [s["response_ids"] for s in kept]
    assert [s["finish_reason"] for s in answered] == [s["finish_reason"] for s in kept]
    assert all(s["rollout_logprobs"] == [] for s in answered)
    assert all(len(s["rollout_logprobs"]) == len(s["response_ids"]) for s in kept)
