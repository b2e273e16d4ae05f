"""Job: PPO/GRPO policy update. Config JSON: ``{"trainer": PolicyConfig fields, "batch_parquet",
"model_path", "reference_model_path", "critic_path" (with trainer.critic), "out_dir"}``."""
from __future__ import annotations

import sys

from batchrl.training.jobs._runtime import Reporter, run_job


def work(config: dict, rep: Reporter):
    from batchrl.training.trainer.config import PolicyConfig
    from batchrl.training.trainer.policy import train_policy

    cfg = PolicyConfig.model_validate(config.get("trainer", {}))
    rep.log(f"train_policy: {cfg.model_dump_json()}")
    result = train_policy(cfg, batch_parquet=config["batch_parquet"], model_path=config["model_path"],
                          reference_model_path=config.get("reference_model_path"),
                          critic_path=config.get("critic_path"),
                          out_dir=config["out_dir"], report=rep.step)
    return result, result.get("model_dir")


if __name__ == "__main__":
    sys.exit(run_job(work))
