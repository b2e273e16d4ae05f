"""Job: DPO training. Config JSON: ``{"trainer": DPOConfig fields, "pairs_parquet",
"reference_parquet", "model_path", "out_dir"}``."""
from __future__ import annotations

import sys

from batchrl.training.jobs._runtime import Reporter, run_job


def work(config: dict, rep: Reporter):
    from batchrl.training.trainer.config import DPOConfig
    from batchrl.training.trainer.dpo import train_dpo

    cfg = DPOConfig.model_validate(config.get("trainer", {}))
    rep.log(f"train_dpo: {cfg.model_dump_json()}")
    result = train_dpo(cfg, pairs_parquet=config["pairs_parquet"], reference_parquet=config["reference_parquet"],
                       model_path=config["model_path"], out_dir=config["out_dir"], report=rep.step)
    return result, result.get("model_dir")


if __name__ == "__main__":
    sys.exit(run_job(work))
