"""DPO loss variants, ZeRO stages on CPU, and the policy update's old-log-prob / IS / KL paths."""
import json

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrl.training.rl.advantages import compute_advantages
from batchrl.training.rollout import make_rollout_engine
from batchrl.training.models.tiny import build_tiny_model
from batchrl.training.trainer.config import DPOConfig, PolicyConfig
from batchrl.training.trainer.dpo import train_dpo
from batchrl.training.trainer.policy import train_policy
from batchrl.training.trainer.reference import compute_reference_logprobs

ARITH = [json.loads(line) for line in open("sample_data/arith/train.jsonl")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    base = str(root / "base")
    build_tiny_model([r["prompt"] + " " + r["answer"] for r in ARITH], base, seed=0, hidden_size=64,
                     intermediate_size=128)
    pairs = pd.DataFrame([{"prompt": r["prompt"], "chosen": r["answer"], "rejected": "no idea, sorry"}
                          for r in ARITH[:32]])  # no id column: row numbers are used
    pairs.to_parquet(root / "pairs.parquet")
    stats = compute_reference_logprobs(base, str(root / "pairs.parquet"), str(root / "ref.parquet"), max_length=64)
    engine = make_rollout_engine("transformers", model_path=base, max_new_tokens=5, temperature=1.0, batch_size=64)
    samples = pd.DataFrame(engine.generate([r["prompt"] for r in ARITH[:8]], n=4, seed=0))
    samples["reward"] = [float(any(c.isdigit() for c in s)) for s in samples["response"]]
    compute_advantages(samples, "grpo").to_parquet(root / "batch.parquet")
    return {"root": root, "base": base, "ref_stats": stats,
            "dpo": dict(pairs_parquet=str(root / "pairs.parquet"), reference_parquet=str(root / "ref.parquet"),
                        model_path=base),
            "policy": dict(batch_parquet=str(root / "batch.parquet"), model_path=base, reference_model_path=base)}


def test_reference_logprobs_table(setup):
    ref = pd.read_parquet(setup["root"] / "ref.parquet")
    assert list(ref.columns) == ["id", "ref_chosen_logp", "ref_rejected_logp", "chosen_len", "rejected_len"]
    assert ref["id"].tolist() == [str(i) for i in range(32)]
    assert (ref["ref_chosen_logp"] < 0).all() and (ref["rejected_len"] > ref["chosen_len"]).all()
    # summed log-probs: the longer rejected completion has the lower total under a random model
    assert ref["ref_rejected_logp"].mean() < ref["ref_chosen_logp"].mean()


@pytest.mark.parametrize("loss_type,extra", [("hinge", {}), ("ipo", {}), ("robust", {"label_smoothing": 0.1}),
                                             ("simpo", {"beta": 2.0, "simpo_gamma": 0.3}), ("orpo", {})])
def test_dpo_loss_variants_learn(setup, tmp_path, loss_type, extra):
    cfg = DPOConfig(epochs=2, micro_batch_size=8, lr=1e-3, loss_type=loss_type, **extra)
    result = train_dpo(cfg, out_dir=str(tmp_path), **setup["dpo"])
    assert np.isfinite(result["loss_curve"]).all()
    assert result["margin_after"] > result["margin_before"] + 0.1


def test_zero3_trains_resumes_and_exports(setup, tmp_path):
    cfg = DPOConfig(epochs=1, micro_batch_size=8, zero_stage=3)
    full = train_dpo(cfg, out_dir=str(tmp_path / "full"), **setup["dpo"])
    train_dpo(cfg.model_copy(update={"stop_after_steps": 2}), out_dir=str(tmp_path / "cut"), **setup["dpo"])
    resumed = train_dpo(cfg, out_dir=str(tmp_path / "cut"), **setup["dpo"])
    assert resumed["resumed_from_step"] == 2
    np.testing.assert_allclose(resumed["loss_curve"], full["loss_curve"], atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "model")
    base = AutoModelForCausalLM.from_pretrained(setup["base"])
    shapes = {k: v.shape for k, v in base.state_dict().items()}
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes  # gathered, not shards


def test_policy_first_step_is_on_policy_and_is_weights_apply(setup, tmp_path):
    cfg = PolicyConfig(micro_batch_size=32, ppo_epochs=1, kl_loss_coef=0.0, rollout_is_threshold=2.0)
    result = train_policy(cfg, out_dir=str(tmp_path / "a"), **setup["policy"])
    first = result["final"]
    # recomputed old log-probs equal the current ones before the update: ratio 1, nothing clipped
    assert abs(first["ppo_kl"]) < 1e-5 and first["pg_clipfrac"] == 0.0
    # trainer and rollout engine agree closely on the same weights: IS weights near 1
    assert first["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert "kl_loss" not in first


def test_policy_uses_rollout_logprobs_and_kl(setup, tmp_path):
    cfg = PolicyConfig(micro_batch_size=8, ppo_epochs=2, kl_loss_coef=0.1, old_logprobs="rollout", lr=1e-2)
    result = train_policy(cfg, out_dir=str(tmp_path), **setup["policy"])
    curve = result["loss_curve"]
    assert len(curve) == 8 and "rollout_is_weight_mean" not in result["final"]
    assert result["final"]["kl_loss"] > 0  # the policy moved away from the reference
    batch = pd.read_parquet(setup["policy"]["batch_parquet"])
    assert result["num_samples"] == int((batch["response_ids"].map(len) > 0).sum())
    w = AutoModelForCausalLM.from_pretrained(result["model_dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(setup["base"]).state_dict()
    assert any(not torch.equal(w[k], b[k]) for k in w)


def test_policy_without_sampled_logprobs(setup, tmp_path):
    """Rollouts from an engine that reports no log-probs (vLLM's default): recompute trains without the IS
    correction; old_logprobs='rollout' is refused with the fix named."""
    batch = pd.read_parquet(setup["policy"]["batch_parquet"])
    batch["rollout_logprobs"] = [[] for _ in range(len(batch))]
    path = str(tmp_path / "no_logprobs.parquet")
    batch.to_parquet(path)
    paths = {**setup["policy"], "batch_parquet": path}
    result = train_policy(PolicyConfig(micro_batch_size=32, kl_loss_coef=0.0), out_dir=str(tmp_path / "a"), **paths)
    assert abs(result["final"]["ppo_kl"]) < 1e-5 and "rollout_is_weight_mean" not in result["final"]
    with pytest.raises(ValueError, match="sampled_logprobs=True"):
        train_policy(PolicyConfig(old_logprobs="rollout"), out_dir=str(tmp_path / "b"), **paths)


def test_activation_checkpointing_and_fused_adamw_keep_the_curve(setup, tmp_path):
    """Memory/speed options change how, not what: the same DPO curve with activation checkpointing (exact on
    CPU) and with the fused AdamW kernel (to float rounding)."""
    base = dict(epochs=1, micro_batch_size=8, lr=1e-3)
    plain = train_dpo(DPOConfig(**base), out_dir=str(tmp_path / "plain"), **setup["dpo"])
    checkpointed = train_dpo(DPOConfig(**base, gradient_checkpointing=True), out_dir=str(tmp_path / "ckpt"),
                             **setup["dpo"])
    fused = train_dpo(DPOConfig(**base, fused_optimizer=True), out_dir=str(tmp_path / "fused"), **setup["dpo"])
    np.testing.assert_allclose(checkpointed["loss_curve"], plain["loss_curve"], atol=1e-6)
    np.testing.assert_allclose(fused["loss_curve"], plain["loss_curve"], atol=1e-5)
    assert plain["loss_curve"][-1] < plain["loss_curve"][0]


def test_speed_options_keep_the_dpo_update(setup, tmp_path):
    """Fused LM-head log-probs, length-grouped micro-batches and deferred metric reads change how the
    step runs, not what it computes: the same curve (float rounding) and weights as the plain path."""
    plain = DPOConfig(epochs=1, micro_batch_size=4, grad_accum=2, fused_logprobs=False, group_by_length=False,
                      metrics_every=1)
    seen = []
    fast = plain.model_copy(update={"fused_logprobs": True, "group_by_length": True, "metrics_every": 3})
    runs = {name: train_dpo(cfg, out_dir=str(tmp_path / name), report=(lambda m, s: seen.append(s))
                            if name == "fast" else None, **setup["dpo"])
            for name, cfg in (("plain", plain), ("fast", fast))}
    np.testing.assert_allclose(runs["fast"]["loss_curve"], runs["plain"]["loss_curve"], atol=2e-5)
    assert seen == list(range(1, runs["fast"]["global_step"] + 1))  # every step reported, in order
    weights = [AutoModelForCausalLM.from_pretrained(tmp_path / name / "model").state_dict() for name in runs]
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-4


def test_length_grouping_cuts_padding():
    from batchrl.training.trainer.batching import step_micro_batches

    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 200, 64).tolist()
    order = rng.permutation(64)
    padded = {}
    for grouped in (False, True):
        batches = [mb for step in range(4) for mb in step_micro_batches(order, step, 4, 4, lengths if grouped else None)]
        assert sorted(np.concatenate(batches).tolist()) == list(range(64))  # same examples, once each
        padded[grouped] = sum(len(mb) * max(lengths[i] for i in mb) - sum(lengths[i] for i in mb) for mb in batches)
        for step in range(4):  # a step keeps its own examples
            mine = np.concatenate(step_micro_batches(order, step, 4, 4, lengths if grouped else None))
            assert set(mine.tolist()) == set(order[step * 16:(step + 1) * 16].tolist())
    assert padded[True] < 0.5 * padded[False]


def test_compiled_layers_match_eager():
    """Regional torch.compile of the decoder layers (``torch_compile: true``) captures the HF layer and
    computes the same forward and gradients (aot_eager here: the graph capture without code generation)."""
    from transformers import Qwen2Config

    from batchrl.training.trainer.loop import compile_layers

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(cfg)
    compiled = AutoModelForCausalLM.from_config(cfg)
    compiled.load_state_dict(eager.state_dict())
    assert compile_layers(compiled, backend="aot_eager") == 2
    x = torch.randint(0, 50, (2, 12))
    for model in (eager, compiled):
        model(x).logits.float().pow(2).mean().backward()
    assert torch.allclose(compiled(x).logits, eager(x).logits, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_compiled_trainer_compiles_only_the_training_steps(setup, tmp_path, monkeypatch):
    """Under ``torch_compile`` the no-grad margin passes before and after training run eager: every graph
    the compiler sees is a training step's (grad mode), none is compiled twice for a once-per-job pass."""
    import batchrl.training.trainer.loop as loop_module

    compile_layers, modes = loop_module.compile_layers, []

    def counting_backend(graph, example_inputs):
        modes.append(torch.is_grad_enabled())
        return graph.forward  # the captured graph, run as is

    monkeypatch.setattr(loop_module, "compile_layers", lambda model: compile_layers(model, backend=counting_backend))
    cfg = DPOConfig(epochs=1, micro_batch_size=8, torch_compile=True)
    result = train_dpo(cfg, out_dir=str(tmp_path), **setup["dpo"])
    assert modes and all(modes), modes
    assert np.isfinite([result["margin_before"], result["margin_after"]]).all()


def test_cpu_jobs_do_not_build_deepspeeds_shared_memory_op():
    """The CPU comm layer would JIT-compile DeepSpeed's shm all-reduce op (~40 s on a fresh machine or venv,
    faults without AVX-512): a CPU job runs without it, on gloo."""
    import deepspeed
    from deepspeed.comm import comm as dist

    from batchrl.training.trainer.engine import init_deepspeed

    init_deepspeed(torch.nn.Linear(4, 4), DPOConfig())
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert dist.cdb is not None and dist.cdb.shm_comm_op is None


def test_margin_pass_in_length_sorted_batches_matches_pair_by_pair(setup):
    from batchrl.training.models.loading import load_model_and_tokenizer
    from batchrl.training.data.batch_layout import encode_pairs
    from batchrl.training.trainer.dpo import _pair_logps, mean_margin

    model, tok = load_model_and_tokenizer(setup["base"])
    rows = [{"prompt": r["prompt"], "chosen": r["answer"] + " " * (i % 5) + "ok" * (i % 7), "rejected": "no" * (1 + i % 4)}
            for i, r in enumerate(ARITH[:23])]  # lengths differ: the sorted batches mix the order up
    items = encode_pairs(tok, rows, 64)
    rng = np.random.default_rng(0)
    ref_c, ref_r = rng.normal(-20, 5, len(items)), rng.normal(-20, 5, len(items))
    with torch.no_grad():
        one_by_one = np.array([float(c - r) for c, r, _, _ in
                               (_pair_logps(model, [it], tok.pad_token_id, "cpu") for it in items)]) - (ref_c - ref_r)
    got = mean_margin(model, items, ref_c, ref_r, tok.pad_token_id, "cpu", batch_size=4)
    assert got["margin"] == pytest.approx(one_by_one.mean(), abs=1e-4)
    assert got["accuracy"] == pytest.approx((one_by_one > 0).mean())
    assert 0 < got["accuracy"] < 1  # both signs occur: a misaligned scatter would change it


def test_measurement_batches_fill_a_token_budget():
    from batchrl.training.data.scoring import length_sorted_batches

    lengths = list(np.random.default_rng(0).integers(1, 300, 500)) + [5000]  # one row over the budget
    batches = length_sorted_batches(lengths, max_tokens=4096)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))  # every row once
    for batch in batches:
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= 4096 or len(batch) == 1
    assert [5000] in [[lengths[i] for i in b] for b in batches]  # the long row alone
    assert len(batches) < len(lengths) / 10  # short rows share batches: dozens per batch
    capped = length_sorted_batches(lengths, 8, max_tokens=4096)
    assert max(len(b) for b in capped) == 8


def test_dpo_refuses_reference_log_probs_over_other_tokens(setup, tmp_path):
    """Reference log-probs truncated shorter than the run's max_length are sums over other tokens: the run
    fails before training, naming the file and the first pair that differs."""
    short = tmp_path / "ref_short.parquet"
    compute_reference_logprobs(setup["base"], setup["dpo"]["pairs_parquet"], str(short), max_length=12)
    with pytest.raises(ValueError, match=r"ref_short\.parquet: pair id '0': the reference log-probs cover \d+ "
                                         r"chosen / \d+ rejected completion tokens, this run tokenises"):
        train_dpo(DPOConfig(epochs=1, micro_batch_size=8, max_length=64), out_dir=str(tmp_path / "out"),
                  **{**setup["dpo"], "reference_parquet": str(short)})


def test_padding_by_array_indexing_equals_row_by_row():
    import random

    from batchrl.training.data.batch_layout import pad_prompt_completion

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 99) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    completions = [[rng.randrange(3, 99) for _ in range(rng.randrange(0, 7))] for _ in range(12)]
    completions[3] = []  # a completion cut to nothing
    out = pad_prompt_completion(prompts, completions, pad_id=1)
    P, R = max(map(len, prompts)), max(map(len, completions))
    for i, (p, c) in enumerate(zip(prompts, completions)):  # the layout, row by row
        row = [1] * (P - len(p)) + p + c + [1] * (R - len(c))
        mask = [0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (R - len(c))
        assert out["input_ids"][i].tolist() == row and out["attention_mask"][i].tolist() == mask
        assert out["position_ids"][i].tolist() == [max(0, k) for k in torch.tensor(mask).cumsum(0).sub(1).tolist()]
        assert out["responses"][i].tolist() == c + [1] * (R - len(c))
        assert out["response_mask"][i].tolist() == [1.0] * len(c) + [0.0] * (R - len(c))
    assert out["input_ids"].dtype == torch.long and out["response_mask"].dtype == torch.float32
