"""Does `batchrl export` of an evaluated policy answer, in plain transformers, as the evaluation asset reported?
(issue 48: "the export loads in transformers and reproduces its GSM8K accuracy"). tests/test_pipeline_e2e.py checks
it on the tiny default; this checks a real model's run, e.g. `batchrl run --profile gsm8k` on the CPU or the GPU.

In the run's environment (BATCHRL_STORAGE, DAGSTER_HOME as the run had them), after an `evaluation`:
    python bench/check_export_answers.py [--out FILE]
It exports the policy the latest evaluation scored, asks each held-out prompt it scored one at a time (chat
template, greedy, the evaluation's token budget: ``training.evaluation.plain_transformers``) and compares accuracy,
mean answer length and each answer the evaluation kept (``num_examples``) with the evaluation's report.
``export_accuracy``: the same for a GPU bench arm's final policy (bench_gpu_rl_vs_trl.py's ``export:ARM``), all
the bench's test questions batched on the GPU, against the bench's own evaluation of that policy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CLI = "import sys; from batchrl.cli.main import console_main; sys.exit(console_main(sys.argv[1:]))"


def first_difference(a: str, b: str) -> int | None:
    """The first character where two answers part (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def exported_answers(policy: str, env: dict, rows: list[dict], max_new_tokens: int, reward: str,
                     **plain) -> tuple[list[str], dict]:
    """`batchrl export` of ``policy`` (in the environment ``env``) into a temporary folder, then plain transformers'
    greedy answers to ``rows`` (``plain``: ``plain_answers``' batch size, device, dtype): the answers and the
    numbers (accuracy by ``reward``, mean tokens, seconds of each part)."""
    from batchrl.training.evaluation.plain_transformers import plain_answers
    from batchrl.training.rewards.registry import get_reward_function

    export = os.path.join(tempfile.mkdtemp(prefix="export-check-"), "export")
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-c", CLI, "export", policy, "--to", export], env=env, check=True)
        exported = time.monotonic()
        answers, lengths = plain_answers(export, [row["prompt"] for row in rows], max_new_tokens, **plain)
    finally:
        shutil.rmtree(os.path.dirname(export), ignore_errors=True)
    correct = get_reward_function(reward)
    return answers, {"policy": policy, "n": len(rows), "max_new_tokens": max_new_tokens,
                     "export_s": round(exported - started, 1),
                     "plain_transformers_s": round(time.monotonic() - exported, 1),
                     "export_accuracy": sum(correct(r["prompt"], a, r) for r, a in zip(rows, answers)) / len(rows),
                     "export_mean_tokens": sum(lengths) / len(rows)}


def export_accuracy(policy: str, env: dict, rows: list[dict], max_new_tokens: int, reward: str, smoke: bool) -> dict:
    """``exported_answers`` for a bench arm's policy: bf16 on the GPU, 128 at a time (``smoke``: float32 on the
    CPU, 4 at a time), with two answers to look at."""
    answers, result = exported_answers(policy, env, rows, max_new_tokens, reward, **(
        {"batch_size": 4} if smoke else {"batch_size": 128, "device": "cuda", "dtype": "bfloat16"}))
    return {**result, "examples": [{"prompt": r["prompt"][:80], "answer": a} for r, a in zip(rows[:2], answers)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the comparison as JSON here")
    args = parser.parse_args()
    import dagster as dg

    from batchrl.training.evaluation.plain_transformers import evaluated_rows

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
    rows = evaluated_rows(lineage)  # one at a time on the CPU, as the evaluation's user would ask them
    answers, result = exported_answers(policy["uri"], dict(os.environ), rows, config["max_new_tokens"],
                                       config["reward"])
    mine = {row["prompt"]: answer for row, answer in zip(rows, answers)}
    kept = [{"prompt": e["prompt"][:80], "equal": mine[e["prompt"]] == e["response"],
             "first_difference_at": first_difference(mine[e["prompt"]], e["response"])}
            for e in reported.get("examples", [])]
    result.update(policy=policy, evaluation_accuracy=reported["arith_accuracy"],
                  evaluation_mean_tokens=reported["mean_response_tokens"], answers_compared=len(kept),
                  answers_equal=sum(k["equal"] for k in kept), answers=kept)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
