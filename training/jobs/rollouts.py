"""Job: sample rollouts. Config JSON: ``{"engine": {"kind", **engine kwargs}, "prompts_parquet",
"n", "seed", "out_parquet", "agent"}`` (``agent``: None, or multi-turn tool use) (see ``batchrl.training.rollout.sampling_job``).

Samples made before the step asked (``common/prefetch_key.py``): the off-policy prefetch (a detached job of the same
request, ``assets/rollout_prefetch.py``) and on-policy sampling ahead (the policy update's job,
``training/rollout/ahead.py``) write their samples and then their statistics (``stats_json``, the mark that they
are complete) into a folder of the request; a later job naming that folder as ``prefetched_from`` takes them
instead of sampling (after waiting for a sampling ahead still under way), else samples itself."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

from batchrl.common.prefetch_key import SAMPLES_FILE, STATS_FILE, sampled_ahead
from batchrl.training.jobs._runtime import Reporter, run_job
from batchrl.training.rollout.sampling_job import write_stats

AHEAD_WAIT_S = 900.0  # a sampling ahead in another process that never finishes: sampled here after this


def _wait_for_sampling_ahead(folder: str) -> None:
    """A folder the policy update's job is filling: wait until it is complete, or its process is gone."""
    mark = sampled_ahead(folder)
    if mark is None:
        return
    if mark.get("pid") == os.getpid():  # this process's own thread: done once joined (its samples, or a failure)
        ahead = sys.modules.get("batchrl.training.rollout.ahead")
        if ahead is not None:
            ahead.wait()  # the worker waits before every job already
        return
    deadline = time.monotonic() + AHEAD_WAIT_S
    while not os.path.exists(os.path.join(folder, STATS_FILE)) and time.monotonic() < deadline:
        try:
            os.kill(int(mark["pid"]), 0)
        except (OSError, KeyError, ValueError):
            return
        time.sleep(0.05)


def work(config: dict, rep: Reporter):
    import pandas as pd

    from batchrl.training.rollout.sampling_job import sample_to_parquet
    from batchrl.training.data.text import prompt_messages

    prefetched = config.get("prefetched_from")
    if prefetched:
        _wait_for_sampling_ahead(prefetched)
    if prefetched and os.path.exists(os.path.join(prefetched, STATS_FILE)):
        started = time.perf_counter()
        shutil.copyfile(os.path.join(prefetched, SAMPLES_FILE), config["out_parquet"])
        with open(os.path.join(prefetched, STATS_FILE)) as f:
            stats = json.load(f)
        shutil.rmtree(prefetched, ignore_errors=True)
        source = "sampled ahead by the last update" if stats.get("sampled_ahead") else \
            "prefetched while the last update trained"
        rep.log(f"took the {stats['samples']} samples {source}")
        return {"sampled_ahead": False, **stats, "prefetched": True,
                "prefetch_take_s": time.perf_counter() - started}, None
    if prefetched:  # handed out but never completed (its job failed or was killed): sampled here
        shutil.rmtree(prefetched, ignore_errors=True)
    table = pd.read_parquet(config["prompts_parquet"])
    prompts = list(table["prompt"])
    rep.log(f"sampling {len(prompts)} prompts x {config['n']} with {config['engine']['kind']}")
    stats = sample_to_parquet(config["engine"], prompts, n=config["n"], seed=config["seed"],
                              out_parquet=config["out_parquet"], messages=prompt_messages(table.to_dict("records")),
                              agent=config.get("agent"))
    if config.get("stats_json"):  # a detached prefetch: the statistics last, so that they mark it complete
        write_stats(config["stats_json"], stats)
    return {**stats, "prefetched": False, "sampled_ahead": False}, None


if __name__ == "__main__":
    sys.exit(run_job(work))
