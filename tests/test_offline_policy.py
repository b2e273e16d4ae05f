"""Policy optimisation on logged completions with rewards: the batch per objective, the refusals, the trainer
job on it, and the asset through Dagster on the shipped scored logs."""
from __future__ import annotations

import json
import math

import dagster as dg
import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from batchrl.training.rl.offline_policy import OfflinePolicyConfig, logged_batch
from batchrl.training.models.loading import load_tokenizer

LOG = pd.DataFrame({
    "prompt": ["1 + 1", "1 + 1", "1 + 1", "2 + 2", "3 + 3"],
    "response": ["2", "3", "11", "4", "6"],
    "score": [1.0, 0.0, 0.0, 1.0, 0.5],
    "source_file": ["logs.jsonl"] * 5, "source_line": [1, 2, 3, 4, 5],
})


def test_grpo_batch_normalises_within_groups_and_leaves_out_lone_responses(arith_model):
    batch, metrics = logged_batch(LOG, load_tokenizer(arith_model), OfflinePolicyConfig(objective="grpo"))
    assert metrics["rows_without_a_group"] == 2 and len(batch) == 3
    std = np.std([1.0, 0.0, 0.0], ddof=1)
    expected = [(1 - 1 / 3) / (std + 1e-6), (0 - 1 / 3) / (std + 1e-6), (0 - 1 / 3) / (std + 1e-6)]
    assert [a[0] for a in batch["advantages"]] == pytest.approx(expected)
    assert all(len(a) == len(r) for a, r in zip(batch["advantages"], batch["response_ids"]))


def test_awr_and_rwr_weights(arith_model):
    tok = load_tokenizer(arith_model)
    awr, _ = logged_batch(LOG, tok, OfflinePolicyConfig(objective="awr", weight_beta=0.5, max_weight=3.0))
    lone_baseline = LOG["score"].mean()  # prompts logged once are measured against the batch mean
    expected = [min(math.exp((s - b) / 0.5), 3.0) for s, b in
                zip(LOG["score"], [1 / 3, 1 / 3, 1 / 3, lone_baseline, lone_baseline])]
    assert [a[0] for a in awr["advantages"]] == pytest.approx(expected)
    rwr, _ = logged_batch(LOG, tok, OfflinePolicyConfig(objective="rwr"))
    weights = [a[0] for a in rwr["advantages"]]
    assert sum(weights[:3]) == pytest.approx(3.0) and weights[3] == pytest.approx(1.0)
    assert weights[0] > weights[1] == pytest.approx(weights[2])


def test_max_rows_keeps_a_seeded_sample_weighted_against_every_logged_score(arith_model):
    tok = load_tokenizer(arith_model)
    full, _ = logged_batch(LOG, tok, OfflinePolicyConfig(objective="awr"))
    capped, metrics = logged_batch(LOG, tok, OfflinePolicyConfig(objective="awr", max_rows=3))
    assert len(capped) == metrics["samples"] == 3 and metrics["rows"] == len(LOG)
    again, _ = logged_batch(LOG, tok, OfflinePolicyConfig(objective="awr", max_rows=3))
    assert again["response_ids"].tolist() == capped["response_ids"].tolist()  # seeded: the same rows each time
    weight_of = {tuple(r): a[0] for r, a in zip(full["response_ids"], full["advantages"])}
    assert [a[0] for a in capped["advantages"]] == pytest.approx([weight_of[tuple(r)] for r in capped["response_ids"]])
    with pytest.raises(ValidationError, match="max_rows"):
        OfflinePolicyConfig(max_rows=0)


def test_importance_weights_need_the_logged_logprobs_of_this_tokenizer(arith_model):
    tok = load_tokenizer(arith_model)
    cfg = OfflinePolicyConfig(objective="grpo", importance_weights=True)
    with pytest.raises(ValueError, match="no 'logprobs' field"):
        logged_batch(LOG, tok, cfg)
    with pytest.raises(ValueError, match=r"logs.jsonl:1: field 'logprobs' holds 1 log-probs"):
        logged_batch(LOG.assign(logprobs=[[-0.1]] * 5), tok, cfg)
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in LOG["response"]]
    logged = LOG.assign(extra=[json.dumps({"logprobs": [-0.5] * len(i)}) for i in ids])
    batch, _ = logged_batch(logged, tok, cfg)
    assert batch["rollout_logprobs"].map(len).tolist() == batch["response_ids"].map(len).tolist()


@pytest.mark.parametrize("fields,message", [
    ({"objective": "awr", "importance_weights": True}, "apply to objective grpo"),
    ({"objective": "grpo", "importance_weights": True, "rollout_is_threshold": None}, "needs rollout_is_threshold"),
    ({"objective": "grpo", "policy_loss": "weighted_regression"}, "clipped surrogate"),
    ({"objective": "awr", "old_logprobs": "rollout"}, "on logged completions"),
])
def test_combinations_that_make_no_sense_are_refused_when_written(fields, message):
    with pytest.raises(ValidationError, match=message):
        OfflinePolicyConfig(**fields)
    assert OfflinePolicyConfig(objective="rwr").policy_loss == "weighted_regression"


def test_awr_update_raises_the_likelihood_of_the_best_logged_answers(arith_model, tmp_path):
    from batchrl.training.jobs._runtime import Reporter
    from batchrl.training.jobs.train_policy import work

    scored = tmp_path / "scored.parquet"
    rows = [{"prompt": f"What is {a} + {a}?", "response": r, "score": s}
            for a in range(1, 9) for r, s in ((str(2 * a), 1.0), (str(2 * a + 1), 0.0))]
    pd.DataFrame(rows).to_parquet(scored)
    offline = OfflinePolicyConfig(objective="awr", weight_beta=0.25, lr=3e-3, micro_batch_size=16, ppo_epochs=4,
                                  kl_loss_coef=0.0)
    config = {"trainer": offline.trainer_fields(), "model_path": arith_model, "out_dir": str(tmp_path / "out"),
              "logged": {"scored_parquet": str(scored), "offline": offline.model_dump()}}
    result, model_dir = work(config, Reporter(None))
    assert result["logged_samples"] == 16 and result["logged_weight_max"] == pytest.approx(math.exp(0.5 / 0.25))

    def margin(path):
        import torch
        from transformers import AutoModelForCausalLM

        model, tok = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(path)
        batch, _ = logged_batch(pd.DataFrame(rows), tok, offline)
        total = []
        for prompt_ids, response_ids in zip(batch["prompt_ids"], batch["response_ids"]):
            ids = torch.tensor([prompt_ids + response_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            tokens = ids[0, 1:]
            total.append(float(logp[torch.arange(len(tokens)), tokens][len(prompt_ids) - 1:].sum()))
        return np.mean(total[0::2]) - np.mean(total[1::2])  # right answers minus wrong ones

    assert margin(model_dir) > margin(arith_model) + 0.5


def test_offline_policy_checkpoint_through_dagster_on_the_shipped_scored_logs(tmp_path):
    """The scored logs of sample_data train the base model with no new samples; the checkpoint's lineage names
    the logs and the base; importance weights on logs without log-probs fail before the trainer starts."""
    from pipeline_helpers import latest_metadata, local_resources, run_assets

    from batchrl.resources import StorageResource

    root = str(tmp_path / "storage")
    data = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "prompts",
            "base_model"]
    ops = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
           "offline_policy_checkpoint": {"config": {"objective": "awr", "micro_batch_size": 16}}}
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = run_assets(local_resources(root), instance, data + ["offline_policy_checkpoint"], {"ops": ops})
        assert result.success
        meta = latest_metadata(instance, "offline_policy_checkpoint")
        assert meta["logged_objective"] == "awr" and meta["logged_samples"] == latest_metadata(instance, "scored_logs")["valid"]
        lineage = StorageResource(root=root).read_lineage({"asset": "offline_policy_checkpoint", "uri": meta["uri"],
                                                           "data_version": meta["data_version"]})
        assert set(lineage["inputs"]) == {"scored_logs", "policy", "reference"}
        ops["offline_policy_checkpoint"] = {"config": {"objective": "grpo", "importance_weights": True}}
        result = run_assets(local_resources(root), instance, ["offline_policy_checkpoint"], {"ops": ops})
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "have no 'logprobs' field" in failure.event_specific_data.error.message
