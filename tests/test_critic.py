"""The critic: value model init, alignment, and PPO with GAE learning on the CPU arithmetic task."""

import numpy as np
import pandas as pd
import pytest
import torch

from batchrl.training.rl.advantages import compute_advantages
from batchrl.training.rewards.registry import REWARD_FUNCTIONS
from batchrl.training.rollout import make_rollout_engine
from batchrl.training.data.batch_layout import pad_prompt_completion
from batchrl.training.trainer.config import PolicyConfig
from batchrl.training.trainer.policy import train_policy
from batchrl.training.models.value_model import is_value_model, load_value_model, predict_values, value_predictions

from arith_pairs import ARITH as TRAIN, ARITH_EVAL as EVAL  # noqa: E402


@pytest.fixture(scope="module")
def base_model(arith_model):
    return arith_model


def test_a_new_critic_predicts_zero_and_reads_the_state_before_each_token(base_model):
    assert not is_value_model(base_model)
    model, tokenizer = load_value_model(base_model)
    table = pd.DataFrame({"prompt_ids": [[5, 6, 7], [8, 9]], "response_ids": [[10, 11], [12, 13, 14]]})
    assert predict_values(base_model, table) == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    with torch.no_grad():  # a head that reads the hidden state: values depend on the prefix only
        model.score.weight.normal_()
    model.eval()
    batch = pad_prompt_completion([[5, 6, 7], [5, 6, 7]], [[10, 11, 12], [10, 99, 98]], tokenizer.pad_token_id)
    values = value_predictions(model, batch)
    assert torch.allclose(values[0, :2], values[1, :2], atol=1e-5)  # same prefix up to token 1
    assert not torch.allclose(values[0, 2], values[1, 2])  # token 2's state has seen a different token 1


def _rollouts(model_path, rows, *, n, seed):
    engine = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=6, temperature=1.0,
                                 batch_size=256)
    samples = engine.generate([r["prompt"] for r in rows], n=n, seed=seed)
    for s in samples:
        s["reward"] = REWARD_FUNCTIONS["arith_partial"](s["prompt"], s["response"], rows[s["prompt_index"]])
    return pd.DataFrame(samples)


@pytest.mark.slow
def test_ppo_with_critic_learns_values_and_raises_the_reward(base_model, tmp_path):
    """PPO (GAE with a learned critic), six iterations like the GRPO learning test: the value loss
    falls between the two passes over each batch, the critic predicts held-out outcomes better than
    zero, and the mean reward rises. Slow (~80 s on the 2-core box): it is the proof that learning works."""
    before = _rollouts(base_model, EVAL, n=8, seed=123)["reward"].mean()
    policy, critic, epoch_means = base_model, base_model, []
    cfg = dict(adv_estimator="gae", critic=True, critic_lr=3e-3, lr=3e-3, micro_batch_size=64, ppo_epochs=2,
               kl_loss_coef=0.001)
    for it in range(6):
        rows = TRAIN[it * 32:(it + 1) * 32]
        samples = _rollouts(policy, rows, n=8, seed=it)
        samples["values"] = predict_values(critic, samples)
        batch = compute_advantages(samples, "gae", gamma=1.0, lam=0.95)
        batch.to_parquet(tmp_path / f"batch{it}.parquet")
        result = train_policy(PolicyConfig(**cfg, seed=it), batch_parquet=str(tmp_path / f"batch{it}.parquet"),
                              model_path=policy, reference_model_path=base_model, critic_path=critic,
                              out_dir=str(tmp_path / f"it{it}"))
        curve = result["critic_value_loss_curve"]
        half = len(curve) // 2  # ppo_epochs=2 passes over the same batch
        epoch_means.append((np.mean(curve[:half]), np.mean(curve[half:])))
        policy, critic = result["model_dir"], str(tmp_path / f"it{it}" / "critic")
        assert is_value_model(critic)
    after = _rollouts(policy, EVAL, n=8, seed=123)["reward"].mean()
    print("ppo+critic reward", before, "->", after, "critic epoch means", np.round(epoch_means, 4))
    assert sum(second < first for first, second in epoch_means) >= 5  # the second pass fits better
    # the critic trained on five batches predicts the sixth batch's outcome better than no critic
    values = np.concatenate([np.asarray(v) for v in samples["values"]])
    outcome = np.concatenate([[r] * len(v) for r, v in zip(samples["reward"], samples["values"])])
    assert np.mean((values - outcome) ** 2) < 0.8 * np.mean(outcome ** 2)
    assert after - before > 0.1


def test_a_critic_from_the_reward_model_starts_at_the_rm_score_of_each_prefix(base_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from batchrl.training.models.loading import load_tokenizer

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1).eval()
    rm.config.pad_token_id = load_tokenizer(base_model).pad_token_id
    rm.save_pretrained(tmp_path / "rm")
    load_tokenizer(base_model).save_pretrained(tmp_path / "rm")
    critic, tokenizer = load_value_model(str(tmp_path / "rm"))
    assert torch.equal(critic.score.weight, rm.score.weight)
    critic.eval()
    prompt, response = [5, 6, 7], [10, 11, 12]
    values = value_predictions(critic, pad_prompt_completion([prompt], [response], tokenizer.pad_token_id))[0]
    with torch.no_grad():
        for t in range(len(response)):  # V(s_t) = RM score of the prompt plus the tokens before t
            prefix = torch.tensor([prompt + response[:t]])
            assert values[t].item() == pytest.approx(rm(input_ids=prefix).logits[0, 0].item(), abs=1e-4)
