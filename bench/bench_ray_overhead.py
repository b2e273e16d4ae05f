"""The `ray` environment's overhead against one machine, per job and per RL iteration (issue 49).

Each arm materialises the same RL chain (rollouts, rewards, advantages, policy_checkpoint) for ``--iterations``
iterations after an untimed preparation (the base model, the prompts), with storage and a Dagster home of its own:
- ``one_machine``: the environment a single host runs (``gpu`` where CUDA is, its warm job worker; ``local`` on a
  CPU box: rollouts in the Dagster process, the trainer a subprocess);
- ``ray_fresh``: ``BATCHRL_ENV=ray`` on a one-node cluster started here (1 rank, the GPU if there is one), every
  job a fresh process on the node (``BATCHRL_RAY_RESIDENT_IDLE_S=0``, as before the resident workers);
- ``ray_resident``: the same with one-process jobs in the node's resident job worker (the default);
- ``ray_driver``: ``ray_resident`` with every job handed to one driver resident on the cluster
  (``BATCHRL_RAY_DRIVER_IDLE_S``) instead of a Ray job per step.
Reported per arm: each step's mean wall over the iterations after the first, the steady iteration (a run's wall),
and the overhead of each ray arm against ``one_machine`` (absolute and as a share of its iteration).

The cluster binds loopback only: the script re-runs itself inside ``unshare --user --net --pid`` (Ray's servers
listen on every interface) with the loopback interface up (``tests/helpers_ray.py``), and the storage root is a
local folder (one machine: no object store needed for the comparison; on a cluster the files go through S3).

    python bench/bench_ray_overhead.py --out /tmp/ray_overhead [--iterations 4] [--gsm8k DIR] [--arms ...]

On the GPU host: bench/ray_overhead_device.sh (the graph, ray and 0.5B bundles carried first).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path[:0] = [BENCH, os.path.join(REPO, "tests")]
CHAIN = "rollouts,rewards,advantages,policy_checkpoint"
PREP = "raw_logs,cleaned_logs,validated_preferences,preference_window,prompts,base_model"
ARMS = ("one_machine", "ray_fresh", "ray_resident", "ray_driver")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def arm_env(state: str, arm: str, dashboard: int) -> dict[str, str]:
    root = os.path.join(state, arm)
    env = {**os.environ, "BATCHRL_STORAGE": os.path.join(root, "storage"), "DAGSTER_HOME": os.path.join(root, "home"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "BATCHRL_ENV": "gpu" if _cuda() else "local"}
    if arm != "one_machine":
        env.update({"BATCHRL_ENV": "ray", "BATCHRL_S3_ROOT": os.path.join(root, "object_store"),
                    "BATCHRL_RAY_ADDRESS": f"http://127.0.0.1:{dashboard}", "BATCHRL_RAY_WORLD_SIZE": "1",
                    "BATCHRL_RAY_GPUS_PER_RANK": "1" if _cuda() else "0",
                    # the rank's threads as one machine's job has them (Ray sets OMP_NUM_THREADS to its CPU slots)
                    "BATCHRL_RAY_CPUS_PER_RANK": str(os.cpu_count()),
                    "BATCHRL_RAY_RESIDENT_IDLE_S": "0" if arm == "ray_fresh" else "600",
                    "BATCHRL_RAY_DRIVER_IDLE_S": "600" if arm == "ray_driver" else "0"})
    os.makedirs(env["DAGSTER_HOME"], exist_ok=True)
    return env


def batchrl(env: dict[str, str], args: list[str], log: str) -> float:
    started = time.monotonic()
    with open(log, "a") as out:
        code = subprocess.call([sys.executable, "-c", "import sys; from batchrl.cli.main import console_main; "
                                "sys.exit(console_main(sys.argv[1:]))", "run", *args], env=env, cwd=REPO,
                               stdout=out, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"batchrl run {' '.join(args)} failed ({code}); see {log}")
    return time.monotonic() - started


def gsm8k_profiles(folder: str, state: str) -> dict[str, str]:
    """profiles/gsm8k.yaml on the release in ``folder`` (``bench_tasks.use_gsm8k``) for ``one_machine``, and for the
    ray arms the same with its gpu environment as the ray environment's: the static-cache engine as the gpu
    environment picks without vLLM, and no trainer backend of its own (the profile's warm worker is one machine's)."""
    import yaml

    from bench_tasks import TASK, use_gsm8k

    use_gsm8k(folder, state, smoke=False)
    with open(TASK["profile"]) as f:
        profile = yaml.safe_load(f)
    profile["resources"].pop("trainer", None)
    ray_env = profile["environments"]["ray"] = profile["environments"]["gpu"]
    ray_env["resources"].pop("trainer", None)
    ray_env["resources"]["rollout_engine"]["kind"] = "static"
    path = os.path.join(state, "gsm8k_ray.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(profile, f)
    return {"one_machine": TASK["profile"], **{arm: path for arm in ARMS if arm != "one_machine"}}


def run_arm(state: str, arm: str, args, dashboard: int) -> dict:
    from bench_gpu_rl_vs_trl import _arm_history

    env = arm_env(state, arm, dashboard)
    log = os.path.join(args.out, f"{arm}.log")
    profile = args.profiles.get(arm, args.profile)
    base = ["--profile", profile] if profile else []
    prep_s = batchrl(env, [*base, "--select", PREP, "--rl-iterations", "1"], log)
    if arm in ("ray_resident", "ray_driver"):  # the node's worker (and driver) warm before the clock, as one_machine's
        batchrl(env, [*base, "--select", "rollouts", "--rl-iterations", "1"], log)
    wall = batchrl(env, [*base, "--select", CHAIN, "--rl-iterations", str(args.iterations)], log)
    history = _arm_history(env)
    runs = sorted([r for r in history["runs"] if any(k.startswith("policy_checkpoint") for k in r["steps"])],
                  key=lambda r: r["start"])[-args.iterations:]
    steady = runs[1:] or runs
    steps = {}
    for stage in CHAIN.split(","):
        walls = [s for r in steady for k, s in r["steps"].items() if k.startswith(stage)]
        steps[stage] = round(sum(walls) / max(len(walls), 1), 2)
    # the Ray path's parts of each job step (ray_launch.run_on_ray's ray_s/*) and the job's own wall, same iterations
    parts = {}
    for stage in ("rollouts", "policy_checkpoint"):
        records = history["meta"].get(stage, [])[-args.iterations:][1:]
        keys = sorted({k for m in records for k in m if k.startswith("ray_s/") or k in ("wall_s", "job_s")})
        parts[stage] = {k: round(sum(m.get(k, 0) for m in records) / max(len(records), 1), 3) for k in keys}
    return {"prep_s": round(prep_s, 1), "wall_s": round(wall, 1), "steps_s": steps,
            "iteration_s": round(sum(r["end"] - r["start"] for r in steady) / len(steady), 2),
            "job_parts_s": parts}


def inside(args) -> int:
    from helpers_ray import DASHBOARD_PORT, bring_loopback_up, only_loopback, start_node, wait_for_nodes

    bring_loopback_up()
    assert only_loopback()
    venv_bin = os.path.dirname(sys.executable)  # the Ray jobs' `python -m` entry point: this interpreter
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{venv_bin}:{os.environ['PATH']}"})
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cuda": _cuda(),
              "iterations": args.iterations, "profile": args.profile, "arms": {}}
    if _cuda():
        import torch

        record["device"] = torch.cuda.get_device_name()
    os.makedirs(args.state, exist_ok=True)
    args.profiles = gsm8k_profiles(args.gsm8k, args.state) if args.gsm8k else {}
    record["profiles"] = {arm: args.profiles.get(arm, args.profile) for arm in args.arms.split(",")}
    # every core a slot; the node's processes as this one's (no thread caps: one machine's arm has none)
    start_node(head=True, num_cpus=os.cpu_count(), env={**os.environ, "PATH": os.environ["PATH"]})
    wait_for_nodes(1)
    for arm in args.arms.split(","):
        started = time.monotonic()
        record["arms"][arm] = run_arm(args.state, arm, args, DASHBOARD_PORT)
        record["arms"][arm]["arm_s"] = round(time.monotonic() - started, 1)
        base = record["arms"].get("one_machine")
        if base and arm != "one_machine":
            extra = record["arms"][arm]["iteration_s"] - base["iteration_s"]
            record["arms"][arm]["overhead_s"] = round(extra, 2)
            record["arms"][arm]["overhead_share"] = round(extra / base["iteration_s"], 3)
        with open(os.path.join(args.out, "ray_overhead.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(json.dumps({arm: record["arms"][arm]}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--state", default="/tmp/ray_overhead_state")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--profile", default="", help="a profile name or file (default: none, the embedded model)")
    parser.add_argument("--gsm8k", default="", help="the GSM8K release's folder: profiles/gsm8k.yaml's model on it")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.inside:
        return inside(args)
    from helpers_ray import namespaces_command

    unshare = namespaces_command()
    if unshare is None:
        raise SystemExit("no user+network namespaces here: Ray would listen on the machine's own network")
    return subprocess.call([*unshare, sys.executable, os.path.abspath(__file__), "--inside", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
