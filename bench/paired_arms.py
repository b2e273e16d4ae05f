"""Two evaluated models of a bench record compared question by question (bench_gpu_rl_vs_trl.py keeps each
model's per-question scores since 2026-12-06): the gain of A over B, its paired standard error and 95% interval,
the questions won and lost. A curve point is ``ARM:K`` (the arm's policy after K iterations / rounds).

    python bench/paired_arms.py bench/results/RECORD.json full@1 trl_vllm [lora full:7 ...]
With two names: A against B. With more: each against the first.
"""
from __future__ import annotations

import argparse
import json
import sys


def scores_of(record: dict, name: str) -> list[float]:
    """``name``'s per-question scores: an arm's final policy (or ``base``), or ``ARM:K`` a curve point."""
    arm, _, point = name.partition(":")
    result = record.get("eval_curve", {}).get(arm, {}).get(point) if point else record.get("eval", {}).get(arm)
    if not result or "arith_scores" not in result:
        known = sorted(record.get("eval", {})) + [f"{a}:{k}" for a, ks in record.get("eval_curve", {}).items()
                                                   for k in ks]
        raise SystemExit(f"{name}: no per-question scores in this record (evaluated: {', '.join(known) or 'none'}; "
                         "records before 2026-12-06's paired scores have none)")
    return result["arith_scores"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("record")
    parser.add_argument("names", nargs="+", help="models: base, an arm, or ARM:K; the first is the baseline when "
                                                 "more than two are given")
    args = parser.parse_args()
    from batchrl.training.evaluation.paired import paired_gain

    with open(args.record) as f:
        record = json.load(f)
    if len(args.names) < 2:
        parser.error("name two models at least")
    # two: A's gain over B; more: each one's over the first
    pairs = [(args.names[0], args.names[1])] if len(args.names) == 2 else \
        [(name, args.names[0]) for name in args.names[1:]]
    for model, baseline in pairs:
        gain = paired_gain(scores_of(record, model), scores_of(record, baseline), prefix="gain")
        print(f"{model} over {baseline}: {gain['gain']:+.2%} (95% {gain['gain_ci95_low']:+.2%} to "
              f"{gain['gain_ci95_high']:+.2%}; se {gain['gain_stderr']:.2%}; won {gain['gain_questions_won']}, "
              f"lost {gain['gain_questions_lost']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
