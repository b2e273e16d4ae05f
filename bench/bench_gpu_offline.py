"""Issue 31's device goal: on SmolLM2-135M-Instruct (the real profile), the offline objectives on the model's own
answers, side by side, then held-out accuracy of each.

1. ``batchrl run --profile real`` (BATCHRL_ENV=gpu): the whole graph, one GRPO iteration: 192 prompts x 8 samples
   scored by ``final_answer`` — the model's own answers with rewards (the ``rewards`` artifact).
2. Those answers become logs in a landing folder of their own: scored logs (prompt, response, score = reward) and
   thumbs (prompt, completion, label = reward >= 1).
3. The same profile over that landing trains, from the same answers and for the same epochs:
   DPO on best-vs-worst pairs (``dpo_pairs`` source scored), KTO on the thumbs (``kto_checkpoint``), AWR on the
   scored completions (``offline_policy_checkpoint``); ``evaluation`` compares them with the base and step 1's
   GRPO policy — one on-policy update on the very same answers — on the held-out split (greedy, per kind).
Writes $OUT/offline_bench.json (accuracies, train seconds, pairs/rows used) and the run logs.

    # device, after the graph bundle is assembled (bench/carry.py prepare graph ...):
    source bench/device_env.sh && python3 bench/bench_gpu_offline.py [--epochs 2]
    # CPU smoke test of the mechanics (the tiny default model instead of SmolLM2):
    .venv/bin/python bench/bench_gpu_offline.py --tiny
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = ["scored_logs", "scored_pairs", "dpo_pairs", "reference_logprobs", "dpo_checkpoint", "feedback_logs",
           "kto_checkpoint", "offline_policy_checkpoint", "evaluation"]
MODELS = ("base_model", "policy_checkpoint", "dpo_checkpoint", "kto_checkpoint", "offline_policy_checkpoint")


def batchrl(args: list[str], env: dict, log: str) -> float:
    """Run the CLI (as ``python -c`` so no console script is needed on the device); its wall seconds."""
    started = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-c", "import sys; from batchrl.cli.main import console_main; "
                               "console_main(sys.argv[1:])", *args], env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        print(open(log).read()[-4000:])
        raise SystemExit(f"batchrl {' '.join(args[:3])} failed ({done.returncode}); log {log}")
    return time.perf_counter() - started


def latest(storage: str, asset: str) -> str:
    folders = sorted(glob.glob(os.path.join(storage, asset, "*", "lineage.json")), key=os.path.getmtime)
    return os.path.dirname(folders[-1])


def own_answers_as_logs(rewards_dir: str, landing: str) -> dict:
    """The rewards table as two logs: scored responses and thumbs (correct = up)."""
    import pandas as pd

    rows = pd.read_parquet(glob.glob(os.path.join(rewards_dir, "*.parquet"))[0])
    rows = rows[rows["response"].str.strip().str.len() > 0]
    for kind in ("scored", "feedback"):
        os.makedirs(os.path.join(landing, kind), exist_ok=True)
    category = rows["category"].fillna("none") if "category" in rows else "none"
    scored = pd.DataFrame({"prompt": rows["prompt"], "response": rows["response"], "score": rows["reward"],
                           "category": category})
    scored.to_json(os.path.join(landing, "scored", "own_answers.jsonl"), orient="records", lines=True)
    thumbs = pd.DataFrame({"prompt": rows["prompt"], "completion": rows["response"],
                           "label": rows["reward"] >= 1.0, "category": category})
    thumbs.to_json(os.path.join(landing, "feedback", "own_thumbs.jsonl"), orient="records", lines=True)
    return {"answers": len(rows), "correct": int((rows["reward"] >= 1.0).sum()),
            "prompts": int(rows["prompt"].nunique())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2, help="epochs of each offline trainer (the same for all)")
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--tiny", action="store_true", help="the tiny default model on CPU (mechanics only)")
    p.add_argument("--work", default="/tmp/batchrl-offline")
    p.add_argument("--reuse-graph", action="store_true", help="skip step 1: the work dir holds its run already")
    args = p.parse_args()
    out = os.environ.get("OUT", os.path.join(args.work, "out"))
    os.makedirs(out, exist_ok=True)
    storage, landing = os.path.join(args.work, "storage"), os.path.join(args.work, "landing")
    env = {**os.environ, "BATCHRL_STORAGE": storage, "DAGSTER_HOME": os.path.join(args.work, "home"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.makedirs(env["DAGSTER_HOME"], exist_ok=True)
    if not args.tiny:
        env.setdefault("BATCHRL_ENV", "gpu")
    profile = [] if args.tiny else ["--profile", "real"]
    result: dict = {"argv": sys.argv[1:], "phases_s": {}}
    if not args.reuse_graph:
        result["phases_s"]["whole_graph"] = batchrl(["run", *profile, "--rl-iterations", "1"], env,
                                                    os.path.join(out, "run_graph.log"))
    result["own_answers"] = own_answers_as_logs(latest(storage, "rewards"), landing)
    precision = {} if args.tiny else {"precision": "bf16_amp"}
    common = {"lr": args.lr, "epochs": args.epochs, "max_length": 64 if args.tiny else 192, **precision}
    config = {"resources": {"landing": {"scored": os.path.join(landing, "scored"),
                                        "feedback": os.path.join(landing, "feedback")}},
              "ops": {"scored_pairs": {"config": {"pair_min_margin": 0.5}},
                      "dpo_pairs": {"config": {"source": "scored"}},
                      "dpo_checkpoint": {"config": {**common, "micro_batch_size": 16}},
                      "kto_checkpoint": {"config": {**common, "micro_batch_size": 16}},
                      "offline_policy_checkpoint": {"config": {
                          "objective": "awr", "weight_beta": 0.5, "lr": args.lr, "ppo_epochs": args.epochs,
                          "micro_batch_size": 16, "max_length": common["max_length"], "kl_loss_coef": 0.0, **precision}}}}
    base_profile = os.path.join(REPO, "profiles", "real.yaml")
    overlay = os.path.join(args.work, "offline_profile.yaml")
    import yaml

    with open(overlay, "w") as f:  # yaml writes 2e-06 as 2.0e-06, which YAML 1.1 reads back as a float
        yaml.safe_dump(_merged(base_profile, config, args.tiny), f)
    result["phases_s"]["offline_objectives"] = batchrl(
        ["run", "--profile", overlay, "--select", ",".join(OFFLINE), "--rl-iterations", "1"], env,
        os.path.join(out, "run_offline.log"))  # one run: the GRPO policy compared is step 1's, on the same answers
    with open(os.path.join(latest(storage, "evaluation"), "evaluation.json")) as f:
        evaluation = json.load(f)
    for name in MODELS:
        metrics = evaluation.get(name, {})
        result[name] = {k: v for k, v in metrics.items() if k.startswith("accuracy") or k in ("accuracy",)}
        if name != "base_model" and name != "policy_checkpoint":
            with open(os.path.join(latest(storage, name), "train_metrics.json")) as f:
                train = json.load(f)
            result[name]["train_job_wall_s"] = train.get("job_wall_s")
            result[name]["train_examples"] = train.get("num_pairs") or train.get("num_examples") or train.get(
                "num_samples")
    with open(os.path.join(out, "offline_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


def _merged(profile_path: str, extra: dict, tiny: bool) -> dict:
    """The real profile (or an empty one for --tiny) with ``extra`` merged in, as a profile of its own."""
    import yaml

    base = {} if tiny else yaml.safe_load(open(profile_path))
    if not tiny:  # its {sample_data} placeholders resolve against the shipped samples
        base["resources"]["landing"] = {k: v.replace("{sample_data}", os.path.join(REPO, "sample_data"))
                                        for k, v in base["resources"]["landing"].items()}
        env = base.get("environments", {}).get("gpu", {})
        for op, body in extra["ops"].items():  # the GPU sizes of the trainers stay, the offline settings win
            env.setdefault("ops", {}).setdefault(op, {}).setdefault("config", {}).update(body["config"])
    base.setdefault("resources", {}).setdefault("landing", {}).update(extra["resources"]["landing"])
    for op, body in extra["ops"].items():
        base.setdefault("ops", {}).setdefault(op, {}).setdefault("config", {}).update(body["config"])
    base.setdefault("description", "offline objectives on the model's own answers (bench/bench_gpu_offline.py)")
    return base


if __name__ == "__main__":
    main()
