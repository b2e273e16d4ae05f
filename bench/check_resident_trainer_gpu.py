"""GPU check of the resident policy trainer under DeepSpeed's bf16 optimiser (``precision: bf16``), a path the CPU
tests cannot reach (bf16 engines are GPU-only here): two RL iterations (``tests/pipeline_helpers.two_rl_iterations``)
on its tiny model, in the job worker on the GPU, with the trainer kept between the updates (its engine retired, a new
one built around the kept module) and with every model loaded from the published files instead. Each variant
(LoRA, full fine-tuning) must give the same data versions and loss curves both ways, the second update reusing the
kept trainer. Prints one JSON object; exits 1 on a difference.

    python3 bench/check_resident_trainer_gpu.py --work /tmp/resident_bf16   # on the device (gpu env)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from pipeline_helpers import RL_LOOP, SMALL, stop_workers, two_rl_iterations  # noqa: E402

VARIANTS = {
    "lora_bf16": {"micro_batch_size": 4, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1, "lr": 1.0e-3,
                  "precision": "bf16"},
    "full_bf16": {"micro_batch_size": 4, "lr": 1.0e-4, "precision": "bf16"},
}


def check(work: str, name: str, policy: dict) -> dict:
    config = {"ops": {**SMALL["ops"], "policy_checkpoint": {"config": policy}}}
    runs = {gb: two_rl_iterations(os.path.join(work, f"{name}-root{gb}"), os.path.join(work, f"{name}-home{gb}"),
                                  gb, config) for gb in ("1", "0")}
    stop_workers(runs)
    kept, files = runs["1"], runs["0"]
    versions = {stage: ([m["data_version"] for m in kept[stage]], [m["data_version"] for m in files[stage]])
                for stage in RL_LOOP}
    return {
        "same_data_versions": all(a == b for a, b in versions.values()),
        "same_loss_curves": [m["loss_curve"] for m in kept["policy_checkpoint"]]
        == [m["loss_curve"] for m in files["policy_checkpoint"]],
        "trainer_reused": [m["trainer_reused"] for m in kept["policy_checkpoint"]],
        "setup_s": [m.get("phase_s/setup") for m in kept["policy_checkpoint"]],
        "policy_versions": versions["policy_checkpoint"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/resident_bf16")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    results = {name: check(args.work, name, policy) for name, policy in VARIANTS.items()}
    print(json.dumps(results, indent=1, default=str))
    ok = all(r["same_data_versions"] and r["same_loss_curves"] and r["trainer_reused"] == [False, True]
             for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
