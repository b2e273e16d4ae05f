"""Job: sample rollouts. Config JSON: ``{"engine": {"kind", **engine kwargs}, "prompts_parquet",
"n", "seed", "out_parquet", "agent"}`` (``agent``: None, or multi-turn tool use) (see ``batchrl.training.rollout.sampling_job``)."""
from __future__ import annotations

import sys

import pandas as pd

from batchrl.training.jobs._runtime import Reporter, run_job


def work(config: dict, rep: Reporter):
    from batchrl.training.rollout.sampling_job import sample_to_parquet
    from batchrl.training.text import prompt_messages

    table = pd.read_parquet(config["prompts_parquet"])
    prompts = list(table["prompt"])
    rep.log(f"sampling {len(prompts)} prompts x {config['n']} with {config['engine']['kind']}")
    stats = sample_to_parquet(config["engine"], prompts, n=config["n"], seed=config["seed"],
                              out_parquet=config["out_parquet"], messages=prompt_messages(table.to_dict("records")),
                              agent=config.get("agent"))
    return stats, None


if __name__ == "__main__":
    sys.exit(run_job(work))
