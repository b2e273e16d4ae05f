"""Job: Bradley-Terry reward-model training. Config JSON: ``{"trainer": RewardModelConfig fields,
"pairs_parquet", "model_path", "out_dir"}``."""
from __future__ import annotations

import sys

from batchrl.training.jobs._runtime import Reporter, run_job


def work(config: dict, rep: Reporter):
    from batchrl.training.trainer.config import RewardModelConfig
    from batchrl.training.trainer.reward import train_reward_model

    cfg = RewardModelConfig.model_validate(config.get("trainer", {}))
    rep.log(f"train_reward_model: {cfg.model_dump_json()}")
    result = train_reward_model(cfg, pairs_parquet=config["pairs_parquet"], model_path=config["model_path"],
                                out_dir=config["out_dir"], report=rep.step)
    return result, result.get("model_dir")


if __name__ == "__main__":
    sys.exit(run_job(work))
