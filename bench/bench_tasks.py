"""The tasks of bench_gpu_rl_vs_trl.py: ``real`` (SmolLM2 on sample_data/real, the default) and ``gsm8k``
(profiles/gsm8k.yaml's model on the GSM8K release: its train split for the arms, all 1,319 test questions greedy at
512 tokens for the evaluation, the gsm8k reward)."""
from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the task: ``real`` (SmolLM2 on sample_data/real) or ``gsm8k`` (profiles/gsm8k.yaml's model on the GSM8K release
# under --gsm8k: train for the arms, all 1,319 test questions greedy at 512 tokens for the evaluation)
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
TASK = {"name": "real", "profile": "real", "reward": "final_answer", "eval_tokens": 16 if SMOKE else 96, "lr": 1e-5,
        "beta": 0.01}
GSM8K_TASK = {"name": "gsm8k", "profile": "gsm8k", "reward": "gsm8k"}  # lr, beta: the profile's (use_gsm8k)


def use_gsm8k(folder: str, state: str, smoke: bool, profile_name: str = "gsm8k") -> tuple | None:
    """The gsm8k task: ``profile_name`` (gsm8k: the 0.5B; gsm8k-1.5b, gsm8k-1.5b-lora) extended by a profile file in
    ``state`` (the arms run it by path) whose landing is the release in ``folder``; the eval set and rewards
    switched. Returns the round's sizes (prompts, samples per prompt, micro-batch, new tokens) of the profile's gpu
    size, None at smoke size. The TRL arms take these and the profile's lr and KL coefficient: the same settings as
    the batchrl arm of that profile (at 1.5B: lr 1e-6, micro-batch 16). They train full weights, so a LoRA profile
    is refused for them (``TASK["lora"]``)."""
    import yaml

    from batchrl.resources.profiles import load_profile

    landing = load_profile(profile_name)["resources"]["landing"]
    if not smoke:
        landing = {"prompts": os.path.join(os.path.abspath(folder), "train.jsonl.gz"),
                   "eval_prompts": os.path.join(os.path.abspath(folder), "test.jsonl.gz")}
    path = os.path.join(state, "gsm8k_bench.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"extends": os.path.join(REPO, "profiles", f"{profile_name}.yaml"),
                        "resources": {"landing": landing}}, f)
    gpu = load_profile(profile_name, "gpu")
    update, recipe = gpu["ops"]["policy_checkpoint"]["config"], gpu["resources"]["rl_recipe"]
    TASK.update(GSM8K_TASK, profile=path, landing=landing, eval_tokens=16 if smoke else 512, lr=update["lr"],
                beta=0.0 if recipe.get("kl_placement") == "none" else recipe["kl_loss_coef"],
                lora=bool(update.get("lora_rank")),
                trl_checkpointing=profile_name != "gsm8k")  # both TRL arms at 1.5B: OOM without it beside vLLM's
    # 35% (2026-12-06); plain `generate` without it is not tried: BENCH_TRL_CHECKPOINTING=0 (trl_arm.py)
    return None if smoke else (gpu["ops"]["rollouts"]["config"]["max_prompts"], recipe["samples_per_prompt"],
                               update["micro_batch_size"], gpu["resources"]["rollout_engine"]["max_new_tokens"])


def task_prompts(split: str) -> list[dict]:
    """The task's training (``train``) or held-out (``eval``) prompts, as the prompts asset reads them."""
    from batchrl.training.data.prompt_shapes import PromptQuarantine
    from batchrl.training.data.prompts import load_prompts

    if TASK["name"] == "real":
        name = "train.jsonl" if split == "train" else "heldout.jsonl"
        return [json.loads(line) for line in open(os.path.join(REPO, "sample_data", "real", name))]
    uri = TASK["landing"]["prompts" if split == "train" else "eval_prompts"]
    return load_prompts(uri, shape="gsm8k", quarantine=PromptQuarantine()).to_dict("records")


