import json
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch

from batchrl.training.data.batch_layout import encode_pairs, pair_logprobs
from batchrl.training.evaluation.evaluate import evaluate_policy
from batchrl.training.rewards.registry import REWARD_FUNCTIONS
from batchrl.training.data.text import encode_prompt_completion, render_prompt
from batchrl.training.models.loading import load_model_and_tokenizer
from batchrl.training.models.tiny import build_tiny_model

ARITH = Path(__file__).resolve().parents[1] / "sample_data" / "arith"


def load_rows(name):
    return [json.loads(line) for line in (ARITH / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model([f"{r['prompt']} {r['answer']}" for r in load_rows("train.jsonl")], str(out), seed=0)
    return str(out)


@pytest.fixture(scope="module")
def pairs():
    rows = load_rows("eval.jsonl")[:12]
    return pd.DataFrame(
        [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": f"{int(r['answer']) + 1} is my answer"} for r in rows]
    )


@torch.no_grad()
def test_pair_logprobs_match_unpadded_forward(model_path, pairs):
    """What evaluation (and the reference pass) computes per pair: the summed completion log-probs of an
    unpadded forward pass, whatever the length-sorted batching."""
    model, tokenizer = load_model_and_tokenizer(model_path)
    items = encode_pairs(tokenizer, pairs.to_dict("records"), 256)
    got = pair_logprobs(model, items, tokenizer.pad_token_id, "cpu", batch_size=5)
    for side in ("chosen", "rejected"):
        sums, lengths = got[f"{side}_logp"], got[f"{side}_len"]
        assert sums.shape == lengths.shape == (len(pairs),)
        for i, (p, c) in enumerate(zip(pairs["prompt"], pairs[side])):
            ids, start = encode_prompt_completion(tokenizer, p, c)
            assert ids[-1] == tokenizer.eos_token_id and lengths[i] == len(ids) - start
            logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], dim=-1)
            expected = logps[torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])].sum()
            assert sums[i] == pytest.approx(expected.item(), abs=1e-4)


def test_evaluate_policy_metrics(model_path, pairs):
    arith = load_rows("eval.jsonl")[:10]
    result = evaluate_policy(model_path, arith_eval=arith, pairs=pairs, max_new_tokens=6, seed=0)
    # the arithmetic metrics agree with a direct greedy decode scored by the rules
    model, tokenizer = load_model_and_tokenizer(model_path)
    exact, partial = [], []
    for row in arith:
        ids = tokenizer(render_prompt(tokenizer, row["prompt"]), return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=6, do_sample=False)
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        exact.append(REWARD_FUNCTIONS["arith_exact"](row["prompt"], text, row))
        partial.append(REWARD_FUNCTIONS["arith_partial"](row["prompt"], text, row))
    assert result["arith_n"] == 10
    assert result["arith_accuracy"] == pytest.approx(sum(exact) / 10)
    assert result["arith_mean_reward"] == pytest.approx(sum(partial) / 10)
    assert 0.0 <= result["arith_format_rate"] <= 1.0 and len(result["examples"]) == 5
    assert result["preference_n"] == 12 and 0.0 <= result["preference_accuracy"] <= 1.0
    assert "rm_mean_score" not in result
    # swapping chosen and rejected flips the accuracy and negates the margin
    swapped = pairs.rename(columns={"chosen": "rejected", "rejected": "chosen"})
    flipped = evaluate_policy(model_path, arith_eval=[], pairs=swapped)
    assert flipped["preference_accuracy"] == pytest.approx(1.0 - result["preference_accuracy"])
    assert flipped["preference_margin"] == pytest.approx(-result["preference_margin"], abs=1e-4)
    assert "arith_accuracy" not in flipped


def test_evaluate_policy_with_reward_model(model_path, pairs, tmp_path):
    from batchrl.training.trainer.config import RewardModelConfig
    from batchrl.training.trainer.reward import train_reward_model

    pairs.to_parquet(tmp_path / "pairs.parquet")
    rm = train_reward_model(RewardModelConfig(epochs=1, micro_batch_size=6), pairs_parquet=str(tmp_path / "pairs.parquet"),
                            model_path=model_path, out_dir=str(tmp_path / "rm"))
    result = evaluate_policy(model_path, arith_eval=load_rows("eval.jsonl")[:4], reward_model_path=rm["model_dir"],
                             max_new_tokens=4)
    assert isinstance(result["rm_mean_score"], float)
    assert "preference_accuracy" not in result


def test_evaluate_models_loads_the_reward_model_once_same_scores(model_path, pairs, tmp_path, monkeypatch):
    from batchrl.training.rewards import reward_model as rm_module
    from batchrl.training.evaluation.evaluate import evaluate_models
    from batchrl.training.trainer.config import RewardModelConfig
    from batchrl.training.trainer.reward import train_reward_model

    pairs.to_parquet(tmp_path / "pairs.parquet")
    rm = train_reward_model(RewardModelConfig(epochs=1, micro_batch_size=6), pairs_parquet=str(tmp_path / "pairs.parquet"),
                            model_path=model_path, out_dir=str(tmp_path / "rm"))
    prompts = load_rows("eval.jsonl")[:4]
    other = str(tmp_path / "other")  # a second model: other weights (seed), same tokenizer
    third = str(tmp_path / "third")
    for path, seed in ((other, 1), (third, 2)):
        build_tiny_model([f"{r['prompt']} {r['answer']}" for r in load_rows("train.jsonl")], path, seed=seed)
    models = {"base": model_path, "other": other, "third": third}
    alone = {name: evaluate_policy(path, arith_eval=prompts, reward_model_path=rm["model_dir"], max_new_tokens=4,
                                   pairs=pairs) for name, path in models.items()}
    assert alone["base"]["rm_mean_score"] != alone["other"]["rm_mean_score"]
    loads, policy_loads = [], []
    real_load = rm_module.load_reward_model
    monkeypatch.setattr(rm_module, "load_reward_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    from batchrl.training.rollout import transformers_engine

    real_policy_load = transformers_engine.load_model_and_tokenizer
    monkeypatch.setattr(transformers_engine, "load_model_and_tokenizer",
                        lambda *a, **k: policy_loads.append(a) or real_policy_load(*a, **k))
    from batchrl.training.evaluation import evaluate as evaluate_module

    encodes = []
    real_encode = evaluate_module.encode_pairs
    monkeypatch.setattr(evaluate_module, "encode_pairs", lambda *a, **k: encodes.append(a) or real_encode(*a, **k))
    read_ahead = []
    real_read = evaluate_module.read_weights
    monkeypatch.setattr(evaluate_module, "read_weights", lambda path, **k: read_ahead.append(
        (path, threading.current_thread().name)) or real_read(path, **k))
    together = evaluate_models(models, arith_eval=prompts,
                               reward_model_path=rm["model_dir"], max_new_tokens=4, pairs=pairs)
    assert len(loads) == 1
    # the third checkpoint's weights were read beside the first ones' evaluation (the second is read when it is
    # copied in: a read begun beside the first model's would not be done in time), and those were copied in
    assert [(path, thread.startswith("read-ahead")) for path, thread in read_ahead] == [(third, True)]
    assert len(encodes) == 1  # one tokenizer: the pairs are tokenised once for every model
    # the checkpoints of one model (same config and tokenizer): loaded once, the others' weights copied in
    assert len(policy_loads) == 1
    for name in alone:  # per-model scores as when each model was evaluated alone
        assert together[name]["rm_mean_score"] == pytest.approx(alone[name]["rm_mean_score"], abs=1e-5)
        assert together[name]["arith_accuracy"] == alone[name]["arith_accuracy"]
        assert together[name]["preference_margin"] == pytest.approx(alone[name]["preference_margin"], abs=1e-5)
        assert "arith_scores" not in together[name]  # per-question scores only when asked for
    # each model against the base, question by question: the gain is the accuracies' difference, counted per question
    paired = evaluate_models(models, arith_eval=load_rows("eval.jsonl")[:12], max_new_tokens=4, paired_with="base",
                             with_scores=True)
    base = paired["base"]["arith_scores"]
    assert len(base) == 12 and "arith_gain" not in paired["base"]
    for name in ("other", "third"):
        mine = paired[name]["arith_scores"]
        assert sum(mine) / 12 == pytest.approx(paired[name]["arith_accuracy"])
        assert paired[name]["arith_gain"] == pytest.approx(paired[name]["arith_accuracy"] - paired["base"]["arith_accuracy"])
        assert paired[name]["arith_gain_questions_won"] == sum(m > b for m, b in zip(mine, base))
        assert paired[name]["arith_gain_questions_lost"] == sum(m < b for m, b in zip(mine, base))


def test_weights_copied_into_a_loaded_model_only_when_they_fit_it(model_path, tmp_path):
    """Another checkpoint of the same model is copied into the loaded one (equal to loading it afresh);
    files that do not cover the model exactly (a tensor missing, another shape) leave it untouched."""
    import shutil

    from safetensors.torch import load_file, save_file

    from batchrl.training.models.weights import load_weights_in_place, read_weights, same_model_files

    def variant(name, change):
        folder = tmp_path / name
        shutil.copytree(model_path, folder)
        tensors = load_file(str(folder / "model.safetensors"))
        save_file(change(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})
        return str(folder)

    shifted = variant("shifted", lambda t: {k: v + 0.01 for k, v in t.items()})
    for record in ("lineage.json", "train_metrics.json"):  # a published checkpoint's own records: not the model
        (tmp_path / "shifted" / record).write_text('{"run": "another"}')
    missing = variant("missing", lambda t: {k: v for i, (k, v) in enumerate(sorted(t.items())) if i})
    reshaped = variant("reshaped", lambda t: {k: (v[:1] if v.dim() == 2 else v) for k, v in t.items()})
    assert same_model_files(model_path, shifted) and not same_model_files(model_path, str(tmp_path))
    config = json.loads((Path(model_path) / "config.json").read_text())
    stored = {**config, "dtype": "float32", "transformers_version": "0.0.1"}  # how it was stored: the same model
    (tmp_path / "shifted" / "config.json").write_text(json.dumps(stored, indent=1))
    assert same_model_files(model_path, shifted)
    (tmp_path / "shifted" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    assert not same_model_files(model_path, shifted)  # a file of the model itself differs
    shutil.copy(Path(model_path) / "config.json", tmp_path / "shifted")
    model, _ = load_model_and_tokenizer(model_path, dtype="bfloat16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for unfit in (missing, reshaped):
        for read_ahead in (None, read_weights(unfit)):
            assert not load_weights_in_place(model, unfit, read_ahead)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fresh, _ = load_model_and_tokenizer(shifted, dtype="bfloat16")
    for read_ahead in (None, read_weights(shifted)):  # from the files, or from their tensors read ahead
        model.load_state_dict(before)
        assert load_weights_in_place(model, shifted, read_ahead)
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_evaluation_takes_the_reference_pass_for_its_model_at_its_truncation(model_path, pairs, tmp_path,
                                                                             monkeypatch):
    """The pairs are scored at the reference pass's truncation (else the log-ratio margins compare sums over
    other tokens), and the model the reference pass ran (the base) is not scored again: its numbers are that
    pass's, so its log-ratio margin is exactly 0."""
    from batchrl.training.evaluation import evaluate as evaluate_module
    from batchrl.training.evaluation.evaluate import evaluate_models
    from batchrl.training.trainer.reference import compute_reference_logprobs

    pairs.assign(id=[str(i) for i in range(len(pairs))]).to_parquet(tmp_path / "pairs.parquet")
    compute_reference_logprobs(model_path, str(tmp_path / "pairs.parquet"), str(tmp_path / "ref.parquet"),
                               max_length=20)
    reference = pd.read_parquet(tmp_path / "ref.parquet")
    other = str(tmp_path / "other")
    build_tiny_model([f"{r['prompt']} {r['answer']}" for r in load_rows("train.jsonl")], other, seed=1)
    passes = []
    real_pass = evaluate_module.pair_logprobs
    monkeypatch.setattr(evaluate_module, "pair_logprobs", lambda *a, **k: passes.append(a) or real_pass(*a, **k))
    got = evaluate_models({"base": model_path, "other": other}, arith_eval=[], pairs=pairs, reference=reference,
                          pair_max_length=20, reference_model="base")
    assert len(passes) == 1  # the other model's only
    assert got["base"]["logratio_margin"] == 0.0 and got["base"]["logratio_accuracy"] == 0.0
    margin = reference["ref_chosen_logp"] - reference["ref_rejected_logp"]
    assert got["base"]["preference_margin"] == pytest.approx(float(margin.mean()))
    # the other model at the reference's truncation: what the reference pass gives for it
    compute_reference_logprobs(other, str(tmp_path / "pairs.parquet"), str(tmp_path / "other.parquet"), max_length=20)
    own = pd.read_parquet(tmp_path / "other.parquet")
    expected = (own["ref_chosen_logp"] - own["ref_rejected_logp"]) - margin
    assert got["other"]["logratio_margin"] == pytest.approx(float(expected.mean()), abs=1e-4)
    untruncated = evaluate_models({"other": other}, arith_eval=[], pairs=pairs, reference=reference)["other"]
    assert untruncated["preference_margin"] != pytest.approx(got["other"]["preference_margin"], abs=1e-3)


@pytest.mark.parametrize("device,dtype,recorded_dtype,reference_version,same", [
    ("cpu", "float32", "auto", "v-base", True),        # auto = float32 on the CPU
    ("cuda", "bfloat16", "auto", "v-base", True),      # auto = bfloat16 on a GPU
    ("cuda", "float16", "auto", "v-base", False),      # another precision: evaluation runs the pass itself
    ("cpu", "float32", "float32", "v-other", False),   # another model's pass
])
def test_reference_pass_read_from_the_reference_lineage(device, dtype, recorded_dtype, reference_version, same):
    from batchrl.assets.evaluation import reference_pass
    from batchrl.resources import Artifact, ComputeResource

    base = Artifact("base_model", "/s/base_model/v-base", "v-base")
    reference = Artifact("reference_logprobs", "/s/reference_logprobs/r", "r", lineage={
        "config": {"max_length": 192, "dtype": recorded_dtype},
        "inputs": {"reference": {"asset": "base_model", "uri": "/s/base_model/x", "data_version": reference_version}}})
    assert reference_pass(reference, base, ComputeResource(device=device, dtype=dtype)) == (192, same)


def test_weights_read_ahead_equal_the_files_and_a_truncated_file_is_named(model_path, tmp_path):
    import shutil

    from safetensors.torch import load_file

    from batchrl.training.models.weights import read_weights

    expected = load_file(str(Path(model_path) / "model.safetensors"))
    got = read_weights(model_path)
    assert got.keys() == expected.keys()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    cut = tmp_path / "cut"
    shutil.copytree(model_path, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(OSError, match=r"model\.safetensors: 10 bytes of tensor data missing"):
        read_weights(str(cut))


def test_preference_metrics_are_reported_per_pair_source():
    import numpy as np
    import pandas as pd

    from batchrl.training.evaluation.evaluate import _preference_metrics

    pairs = pd.DataFrame({"pair_source": ["logged/a.jsonl", "logged/a.jsonl", "scored/s.jsonl", None]})
    logps = {"chosen_logp": np.array([-1.0, -5.0, -1.0, -1.0]), "rejected_logp": np.array([-2.0, -2.0, -3.0, -0.5])}
    reference = pd.DataFrame({"ref_chosen_logp": [-1.0] * 4, "ref_rejected_logp": [-1.0, -1.0, -4.0, -1.0]})
    out = _preference_metrics(logps, pairs, reference)
    assert out["preference_accuracy"] == 0.5 and out["preference_n"] == 4
    assert (out["preference_accuracy/logged/a.jsonl"], out["preference_n/logged/a.jsonl"]) == (0.5, 2)
    assert out["preference_accuracy/scored/s.jsonl"] == 1.0 and out["preference_accuracy/unknown"] == 0.0
    assert out["logratio_accuracy/scored/s.jsonl"] == 0.0  # margin 2 against the reference's 3
    assert "preference_accuracy/logged/a.jsonl" not in _preference_metrics(logps, pairs.drop(columns="pair_source"),
                                                                           None)
