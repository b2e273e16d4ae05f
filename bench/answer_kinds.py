"""What kind of answer each evaluated policy writes, and how often each kind is right (issue 48).

The 1.5B Coder base often answers GSM8K by writing a Python program and then an ``output`` block it made up, and
RL's fast gain looked like it came from leaving that habit; this counts it over every answer instead of the two
the record keeps. Reads the ``answers/NAME.jsonl.gz`` files ``bench_gpu_rl_vs_trl.py``'s ``eval`` writes:

    python bench/answer_kinds.py OUT/answers [--json out.json] [--against base]   # --against: per question, the
        # kind it had in base's answers -> the kind it has now, and how many of those questions each got right
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


def kind_transitions(before: list[dict], after: list[dict], reward) -> dict[str, dict[str, int]]:
    """Paired over the same questions: ``"KIND -> KIND"``: how many questions went from the one kind of answer to
    the other, and how many of them were right before and after. Where a policy's gain came from, question by
    question: leaving a kind of answer, or the same kind answered better."""
    if [row["prompt"] for row in before] != [row["prompt"] for row in after]:
        raise ValueError("the two answer files hold different questions (or a different order): not paired")
    table: dict[str, dict[str, int]] = {}
    for was, now in zip(before, after):
        cell = table.setdefault(f"{answer_kind(was['response'])} -> {answer_kind(now['response'])}",
                                {"n": 0, "right_before": 0, "right_after": 0})
        cell["n"] += 1
        cell["right_before"] += int(reward("", was["response"], {"answer": was["answer"]}))
        cell["right_after"] += int(reward("", now["response"], {"answer": now["answer"]}))
    return dict(sorted(table.items(), key=lambda item: -item[1]["n"]))


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
    parser.add_argument("--against", metavar="NAME", help="also pair every other file's answers with NAME's")
    parser.add_argument("--answer", metavar="MODEL_FOLDER", help="first answer with this model on the CPU")
    parser.add_argument("--first", type=int, default=64, help="--answer: this many test questions")
    parser.add_argument("--gsm8k", default="../shared/data/gsm8k", help="--answer: the GSM8K release's folder")
    args = parser.parse_args()
    if args.answer:
        answer_on_cpu(args.answer, args.gsm8k, args.first, args.answers)
    from batchrl.training.rewards.registry import get_reward_function

    reward = get_reward_function("gsm8k")
    answers: dict[str, list[dict]] = {}
    for name in sorted(os.listdir(args.answers)):
        if name.endswith(".jsonl.gz"):
            with gzip.open(os.path.join(args.answers, name), "rt") as f:
                answers[name.removesuffix(".jsonl.gz")] = [json.loads(line) for line in f]
    result = {name: kinds_of(rows, reward) for name, rows in answers.items()}
    for name, kinds in result.items():
        print(name, "  ".join(f"{kind} {k['share']:.1%} (right {k['accuracy']:.1%})" for kind, k in kinds.items()))
    if args.against:
        pairs = {name: kind_transitions(answers[args.against], rows, reward)
                 for name, rows in answers.items() if name != args.against}
        for name, table in pairs.items():
            print(f"{args.against} -> {name}, per question:")
            for change, cell in table.items():
                print(f"  {change:34s} {cell['n']:5d}  right {cell['right_before']:4d} -> {cell['right_after']:4d}"
                      f"  ({cell['right_after'] - cell['right_before']:+d})")
        result = {"kinds": result, f"paired_with_{args.against}": pairs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
