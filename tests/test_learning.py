"""Learning is real: DPO widens the preference margin; GRPO iterations raise the arith reward.

CPU, fixed seeds, the embedded tiny random-init Qwen2 (no download). Thresholds sit well below the
measured effect (see the asserts) but far above noise: a broken loss sign or a no-op optimiser fails.
"""

import numpy as np
import pandas as pd
import pytest

from batchrl.training.rl.advantages import compute_advantages
from batchrl.training.rewards.registry import REWARD_FUNCTIONS
from batchrl.training.rollout import make_rollout_engine
from batchrl.training.trainer.config import DPOConfig, PolicyConfig
from batchrl.training.trainer.dpo import train_dpo
from batchrl.training.trainer.policy import train_policy
from batchrl.training.trainer.reference import compute_reference_logprobs

from arith_pairs import ARITH as TRAIN, ARITH_EVAL as EVAL  # noqa: E402


@pytest.fixture(scope="module")
def base_model(arith_model):
    return arith_model


def test_dpo_raises_the_preference_margin(base_model, tmp_path):
    rng = np.random.default_rng(0)
    pairs = pd.DataFrame([{"id": r["id"], "prompt": r["prompt"], "chosen": r["answer"],
                           "rejected": str(int(r["answer"]) + int(rng.integers(1, 6)))} for r in TRAIN[:64]])
    pairs.to_parquet(tmp_path / "pairs.parquet")
    compute_reference_logprobs(base_model, str(tmp_path / "pairs.parquet"), str(tmp_path / "ref.parquet"),
                               max_length=64)
    result = train_dpo(DPOConfig(epochs=3, lr=1e-3, micro_batch_size=8), pairs_parquet=str(tmp_path / "pairs.parquet"),
                       reference_parquet=str(tmp_path / "ref.parquet"), model_path=base_model,
                       out_dir=str(tmp_path / "dpo"))
    print("dpo", {k: result[k] for k in ("margin_before", "margin_after", "accuracy_before", "accuracy_after")})
    assert abs(result["margin_before"]) < 1e-4  # policy == reference at the start
    assert result["margin_after"] - result["margin_before"] > 0.8  # measured 1.77
    assert result["accuracy_after"] >= 0.6
    assert np.mean(result["loss_curve"][-8:]) < np.mean(result["loss_curve"][:8])


def _rollout_rewards(model_path, rows, *, n, seed):
    engine = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=6, temperature=1.0,
                                 batch_size=256)
    samples = engine.generate([r["prompt"] for r in rows], n=n, seed=seed)
    for s in samples:
        s["reward"] = REWARD_FUNCTIONS["arith_partial"](s["prompt"], s["response"], rows[s["prompt_index"]])
    return pd.DataFrame(samples)


def test_grpo_iterations_raise_the_arith_reward(base_model, tmp_path):
    before = _rollout_rewards(base_model, EVAL, n=8, seed=123)["reward"].mean()
    model, prompts_per_iter = base_model, 32
    for it in range(6):
        rows = TRAIN[it * prompts_per_iter:(it + 1) * prompts_per_iter]
        batch = compute_advantages(_rollout_rewards(model, rows, n=8, seed=it), "grpo")
        batch.to_parquet(tmp_path / f"batch{it}.parquet")
        result = train_policy(PolicyConfig(lr=3e-3, micro_batch_size=64, ppo_epochs=2, kl_loss_coef=0.001, seed=it),
                              batch_parquet=str(tmp_path / f"batch{it}.parquet"), model_path=model,
                              reference_model_path=base_model, out_dir=str(tmp_path / f"policy{it}"))
        model = result["model_dir"]
    after = _rollout_rewards(model, EVAL, n=8, seed=123)["reward"].mean()
    print("grpo mean arith_partial reward", before, "->", after)
    assert after - before > 0.1  # measured 0.04 -> 0.22
