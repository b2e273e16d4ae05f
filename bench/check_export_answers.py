"""Does `batchrl export` of an evaluated policy answer, in plain transformers, as the evaluation asset reported?
(issue 48: "the export loads in transformers and reproduces its GSM8K accuracy"). tests/test_pipeline_e2e.py checks
it on the tiny default; this checks a real model's run, e.g. `batchrl run --profile gsm8k` on the CPU or the GPU.

In the run's environment (BATCHRL_STORAGE, DAGSTER_HOME as the run had them), after an `evaluation`:
    python bench/check_export_answers.py [--out FILE]
It exports the policy the latest evaluation scored, asks each held-out prompt it scored one at a time (chat
template, greedy, the evaluation's token budget: ``training.evaluation.plain_transformers``) and compares accuracy,
mean answer length and each answer the evaluation kept (``num_examples``) with the evaluation's report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def first_difference(a: str, b: str) -> int | None:
    """The first character where two answers part (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the comparison as JSON here")
    args = parser.parse_args()
    import dagster as dg

    from batchrl.cli.main import main as batchrl
    from batchrl.training.evaluation.plain_transformers import evaluated_rows, plain_answers
    from batchrl.training.rewards.registry import get_reward_function

    with dg.DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("evaluation"))
    if event is None:
        sys.exit(f"no evaluation in {os.environ.get('DAGSTER_HOME')}: run one first")
    folder = event.asset_materialization.metadata["uri"].value
    with open(os.path.join(folder, "lineage.json")) as f:
        lineage = json.load(f)
    with open(os.path.join(folder, "evaluation.json")) as f:
        reported = json.load(f)["policy_checkpoint"]
    config, policy = lineage["config"], lineage["inputs"]["policy_checkpoint"]
    export = os.path.join(tempfile.mkdtemp(prefix="export-check-"), "export")
    if batchrl(["export", policy["uri"], "--to", export]) != 0:
        sys.exit("batchrl export failed")
    rows = evaluated_rows(lineage)
    started = time.monotonic()
    answers, lengths = plain_answers(export, [row["prompt"] for row in rows], config["max_new_tokens"])
    correct = get_reward_function(config["reward"])
    mine = {row["prompt"]: answer for row, answer in zip(rows, answers)}
    kept = [{"prompt": e["prompt"][:80], "equal": mine[e["prompt"]] == e["response"],
             "first_difference_at": first_difference(mine[e["prompt"]], e["response"])}
            for e in reported.get("examples", [])]
    result = {"policy": policy, "n": len(rows), "max_new_tokens": config["max_new_tokens"],
              "evaluation_accuracy": reported["arith_accuracy"],
              "export_accuracy": sum(correct(r["prompt"], a, r) for r, a in zip(rows, answers)) / len(rows),
              "evaluation_mean_tokens": reported["mean_response_tokens"],
              "export_mean_tokens": sum(lengths) / len(rows),
              "answers_compared": len(kept), "answers_equal": sum(k["equal"] for k in kept), "answers": kept,
              "plain_transformers_s": round(time.monotonic() - started, 1)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
