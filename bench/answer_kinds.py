"""What kind of answer each evaluated policy writes, and how often each kind is right (issue 48).

The 1.5B Coder base often answers GSM8K by writing a Python program and then an ``output`` block it made up, and
RL's fast gain looked like it came from leaving that habit; this counts it over every answer instead of the two
the record keeps. Reads the ``answers/NAME.jsonl.gz`` files ``bench_gpu_rl_vs_trl.py``'s ``eval`` writes:

    python bench/answer_kinds.py OUT/answers [--json out.json]
    python bench/answer_kinds.py DIR --answer MODEL_FOLDER --first 64 --gsm8k ../shared/data/gsm8k   # on the CPU:
        # the model's greedy answers (512 tokens, float32) to the first 64 test questions into DIR/NAME.jsonl.gz

Kinds, first match wins: ``program+output`` (a code block, then an ``output`` block: the run is imagined, as no
tool runs in these rollouts), ``program`` (a code block only), ``text`` (no code block). Right = the gsm8k reward.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re

_FENCE = re.compile(r"```([^`\n]*)")  # a fence and the rest of its line: an opening one's language


def answer_kind(response: str) -> str:
    """``program+output``, ``program`` or ``text`` (module docstring)."""
    languages = [lang.strip().lower() for lang in _FENCE.findall(response)[::2]]  # every other fence opens a block
    if not languages:
        return "text"
    return "program+output" if "output" in languages[1:] else "program"


def kinds_of(rows: list[dict], reward) -> dict[str, dict[str, float]]:
    """Per kind: its share of the answers and its accuracy; ``all``: the accuracy over every answer."""
    table: dict[str, list[float]] = {}
    for row in rows:
        table.setdefault(answer_kind(row["response"]), []).append(reward("", row["response"], {"answer": row["answer"]}))
    n = max(len(rows), 1)
    out = {kind: {"share": len(scores) / n, "accuracy": sum(scores) / len(scores), "n": len(scores)}
           for kind, scores in sorted(table.items())}
    out["all"] = {"share": 1.0, "accuracy": sum(sum(s) for s in table.values()) / n, "n": len(rows)}
    return out


def answer_on_cpu(model: str, gsm8k: str, first: int, out: str) -> None:
    """``model``'s greedy answers to the first ``first`` GSM8K test questions (the profiles' prompt), as the bench's
    evaluation writes them."""
    from batchrl.training.data.prompt_shapes import PromptQuarantine
    from batchrl.training.data.prompts import load_prompts
    from batchrl.training.evaluation.evaluate import evaluate_models

    rows = load_prompts(os.path.join(gsm8k, "test.jsonl.gz"), shape="gsm8k",
                        quarantine=PromptQuarantine()).to_dict("records")[:first]
    name = os.path.basename(os.path.normpath(model))
    result = evaluate_models({name: model}, arith_eval=rows, max_new_tokens=512, batch_size=32, reward="gsm8k",
                             format_reward="format_gsm8k", num_examples=len(rows))[name]
    write_answers(os.path.join(out, f"{name}.jsonl.gz"), result["examples"])


def write_answers(path: str, examples: list[dict]) -> None:
    """An evaluation's kept answers (``num_examples`` all of them) as the NAME.jsonl.gz this module reads."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt") as f:
        for row in examples:
            f.write(json.dumps({k: row[k] for k in ("prompt", "response", "answer")}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("answers", help="the folder of NAME.jsonl.gz files")
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument("--answer", metavar="MODEL_FOLDER", help="first answer with this model on the CPU")
    parser.add_argument("--first", type=int, default=64, help="--answer: this many test questions")
    parser.add_argument("--gsm8k", default="../shared/data/gsm8k", help="--answer: the GSM8K release's folder")
    args = parser.parse_args()
    if args.answer:
        answer_on_cpu(args.answer, args.gsm8k, args.first, args.answers)
    from batchrl.training.rewards.registry import get_reward_function

    reward = get_reward_function("gsm8k")
    result = {}
    for name in sorted(os.listdir(args.answers)):
        if name.endswith(".jsonl.gz"):
            with gzip.open(os.path.join(args.answers, name), "rt") as f:
                result[name.removesuffix(".jsonl.gz")] = kinds_of([json.loads(line) for line in f], reward)
    for name, kinds in result.items():
        print(name, "  ".join(f"{kind} {k['share']:.1%} (right {k['accuracy']:.1%})" for kind, k in kinds.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
