"""Summarise a `batchrl run` from its Dagster instance: wall time per asset and run, the metadata of
every materialisation in order (rewards per RL iteration, rollout and training speed, KL) and the
final evaluation. `python bench/real_run_report.py OUT_DIR` with DAGSTER_HOME set; writes
OUT_DIR/real_run.json and prints a Markdown summary for bench/RESULTS.md."""
from __future__ import annotations

import json
import os
import sys

import dagster as dg

KEEP = ("iteration", "samples", "generate_s", "generated_tokens_per_s", "mean_response_tokens", "stop_rate",
        "mean_reward", "reward_std", "mean_reward_by_category", "job_wall_s", "wall_s", "batch_mean_reward",
        "num_samples", "optimizer_steps", "steps", "pairs", "self_pairs", "logged_pairs", "train_accuracy_after",
        "final/kl_loss", "final/ppo_kl", "final/pg_loss", "final/entropy", "final/loss", "final/grad_norm",
        "final/pg_clipfrac")  # a key "family/part" is kept when its family is (mean_reward_by_category/arith)


def step_times(instance: dg.DagsterInstance, run_id: str) -> dict[str, float]:
    starts, times = {}, {}
    for event in instance.all_logs(run_id):
        if not event.is_dagster_event:
            continue
        kind, step = event.dagster_event.event_type_value, event.step_key
        if kind == "STEP_START":
            starts[step] = event.timestamp
        elif kind in ("STEP_SUCCESS", "STEP_FAILURE") and step in starts:
            times[step] = round(event.timestamp - starts[step], 2)
    return times


def main(out_dir: str) -> None:
    with dg.DagsterInstance.get() as instance:
        runs = sorted(instance.get_runs(), key=lambda r: instance.get_run_stats(r.run_id).start_time or 0)
        report = {"runs": []}
        for run in runs:
            stats = instance.get_run_stats(run.run_id)
            report["runs"].append({"run_id": run.run_id, "status": run.status.value,
                                   "wall_s": round((stats.end_time or 0) - (stats.start_time or 0), 1),
                                   "step_s": step_times(instance, run.run_id)})
        history = {}
        for asset in ("rollouts", "rewards", "policy_checkpoint", "dpo_pairs", "dpo_checkpoint", "reward_model"):
            records = instance.fetch_materializations(dg.AssetKey(asset), limit=100).records
            history[asset] = [{k: v.value for k, v in r.asset_materialization.metadata.items()
                               if k in KEEP or k.split("/")[0] in KEEP} for r in reversed(records)]
        report["history"] = history
        event = instance.get_latest_materialization_event(dg.AssetKey("evaluation"))
        if event is not None:
            with open(os.path.join(event.asset_materialization.metadata["uri"].value, "evaluation.json")) as f:
                report["evaluation"] = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "real_run.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    for i, run in enumerate(report["runs"]):
        print(f"run {i}: {run['status']} {run['wall_s']} s  {run['step_s']}")
    for asset, rows in history.items():
        for i, row in enumerate(rows):
            print(f"{asset}[{i}]: {row}")
    for model, metrics in report.get("evaluation", {}).items():
        print(model, {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})


if __name__ == "__main__":
    main(sys.argv[1])
