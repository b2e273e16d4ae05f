"""End-to-end pipeline: wall time per asset and bit-for-bit reproducibility.

Runs every asset twice on the shipped sample data, each time in a fresh storage root and a fresh
Dagster instance, and prints per-step seconds and whether each asset's data version (content hash of
its files: Parquet, safetensors, JSON) matched between the two runs.

    .venv/bin/python bench/bench_pipeline.py [--small]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import dagster as dg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from pipeline_helpers import latest_metadata, local_resources, run_assets  # noqa: E402

ASSETS = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
          "prompts", "base_model", "reward_model", "rollouts", "rewards", "advantages", "policy_checkpoint",
          "reference_logprobs", "dpo_checkpoint", "evaluation"]
SMALL = {"ops": {"base_model": {"config": {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2}},
                 "rollouts": {"config": {"max_prompts": 32}},
                 "reward_model": {"config": {"epochs": 1}}, "dpo_checkpoint": {"config": {"epochs": 1}}},
         "resources": {"rl_recipe": {"config": {"samples_per_prompt": 4}}}}


def one_run(run_config: dict) -> tuple[dict, dict, float]:
    root = tempfile.mkdtemp(prefix="bench-pipeline-")
    os.makedirs(os.path.join(root, "home"))
    start = time.perf_counter()
    with dg.DagsterInstance.local_temp(os.path.join(root, "home")) as instance:
        result = run_assets(local_resources(os.path.join(root, "storage")), instance, run_config=run_config)
        assert result.success, "pipeline failed"
        seconds = {e.step_key: e.event_specific_data.duration_ms / 1000
                   for e in result.all_events if e.event_type_value == "STEP_SUCCESS"}
        versions = {a: latest_metadata(instance, a)["data_version"] for a in ASSETS}
    return seconds, versions, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="the CI test's smaller model and sampling")
    args = parser.parse_args()
    run_config = SMALL if args.small else {}
    (sec_a, ver_a, wall_a), (sec_b, ver_b, wall_b) = one_run(run_config), one_run(run_config)
    print(f"{'asset':<24}{'run 1 s':>9}{'run 2 s':>9}  same data version")
    for asset in ASSETS:
        print(f"{asset:<24}{sec_a.get(asset, 0):>9.1f}{sec_b.get(asset, 0):>9.1f}  {ver_a[asset] == ver_b[asset]}"
              f"  {ver_a[asset]}")
    print(f"{'whole run (wall)':<24}{wall_a:>9.1f}{wall_b:>9.1f}")
    print("identical:", sum(ver_a[a] == ver_b[a] for a in ASSETS), "of", len(ASSETS))


if __name__ == "__main__":
    main()
