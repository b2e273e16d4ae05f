"""Job: KTO training on unpaired feedback. Config JSON: ``{"trainer": KTOConfig fields, "feedback_parquet",
"model_path", "out_dir"}``."""
from __future__ import annotations

import sys

from batchrl.training.jobs._runtime import Reporter, run_job


def work(config: dict, rep: Reporter):
    from batchrl.training.trainer.config import KTOConfig
    from batchrl.training.trainer.kto import train_kto

    cfg = KTOConfig.model_validate(config.get("trainer", {}))
    rep.log(f"train_kto: {cfg.model_dump_json()}")
    result = train_kto(cfg, feedback_parquet=config["feedback_parquet"], model_path=config["model_path"],
                       out_dir=config["out_dir"], report=rep.step)
    return result, result.get("model_dir")


if __name__ == "__main__":
    sys.exit(run_job(work))
