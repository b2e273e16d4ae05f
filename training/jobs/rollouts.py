"""Job: sample rollouts. Config JSON: ``{"engine": {"kind", **engine kwargs}, "prompts_parquet",
"n", "seed", "out_parquet", "agent"}`` (``agent``: None, or multi-turn tool use) (see ``batchrl.training.rollout.sampling_job``).

Off-policy prefetch (``assets/rl.py``, ``rollout_prefetch``): a detached job of the same request writes its samples
and then its statistics (``stats_json``, the mark that it is complete) into a folder of its own; a later job
naming that folder as ``prefetched_from`` takes them instead of sampling, else samples itself."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pandas as pd

from batchrl.training.jobs._runtime import Reporter, run_job

STATS_FILE = "stats.json"


def work(config: dict, rep: Reporter):
    from batchrl.training.rollout.sampling_job import sample_to_parquet
    from batchrl.training.text import prompt_messages

    prefetched = config.get("prefetched_from")
    if prefetched and os.path.exists(os.path.join(prefetched, STATS_FILE)):
        started = time.perf_counter()
        shutil.copyfile(os.path.join(prefetched, "samples.parquet"), config["out_parquet"])
        with open(os.path.join(prefetched, STATS_FILE)) as f:
            stats = json.load(f)
        shutil.rmtree(prefetched, ignore_errors=True)
        rep.log(f"took the {stats['samples']} samples prefetched while the last update trained")
        return {**stats, "prefetched": True, "prefetch_take_s": time.perf_counter() - started}, None
    table = pd.read_parquet(config["prompts_parquet"])
    prompts = list(table["prompt"])
    rep.log(f"sampling {len(prompts)} prompts x {config['n']} with {config['engine']['kind']}")
    stats = sample_to_parquet(config["engine"], prompts, n=config["n"], seed=config["seed"],
                              out_parquet=config["out_parquet"], messages=prompt_messages(table.to_dict("records")),
                              agent=config.get("agent"))
    if config.get("stats_json"):  # a detached prefetch: the statistics last, so that they mark it complete
        with open(config["stats_json"] + ".tmp", "w") as f:
            json.dump({k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}, f)
        os.replace(config["stats_json"] + ".tmp", config["stats_json"])
    return {**stats, "prefetched": False}, None


if __name__ == "__main__":
    sys.exit(run_job(work))
