"""Job: reference log-probs of preference pairs. Config JSON: ``{"model_path", "pairs_parquet",
"out_parquet", "max_length", "batch_size", "batch_tokens"}``."""
from __future__ import annotations

import os
import sys

from batchrl.training.jobs._runtime import Reporter, run_job


def work(config: dict, rep: Reporter):
    from batchrl.training.trainer.reference import compute_reference_logprobs

    stats = compute_reference_logprobs(config["model_path"], config["pairs_parquet"], config["out_parquet"],
                                       max_length=config.get("max_length", 256),
                                       batch_size=config.get("batch_size", 16),
                                       batch_tokens=config.get("batch_tokens"))
    return stats, os.path.dirname(os.path.abspath(config["out_parquet"]))


if __name__ == "__main__":
    sys.exit(run_job(work))
