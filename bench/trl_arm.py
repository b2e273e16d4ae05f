"""The TRL arms of bench_gpu_rl_vs_trl.py: TRL 1.16's GRPOTrainer at batchrl's settings, for a number of minutes of
training, over one device call or several (``resume``: the run goes on from the checkpoint its last call saved, and
only training time counts, as the issue asks of a longer run).

A device call lasts at most 600 s, and an 8-minute TRL arm with vLLM colocated (its engine's start, the round in
progress at the budget, the saves: bench/RESULTS.md) has no margin in one, so it runs as ``--parts trl_vllm
--minutes 4`` then ``--parts more:trl_vllm --minutes 8``. What the split costs TRL: the resumed call's first round
carries its warm-up (first kernels, the engine's first weight sync) on TRL's clock, as batchrl's first iteration
carries its builds on batchrl's; compare its rounds after the first of each call when that matters.
"""
from __future__ import annotations

import json
import os
import shutil
import time

from bench_tasks import TASK, task_prompts


def run_trl_arm(base: str, minutes: float, state: str, arm: str, sizes: tuple[int, int, int, int], *, bf16: bool,
                resume: bool = False, curve_every: int = 0, seed: int = 0) -> dict:
    """TRL's GRPOTrainer until ``minutes`` of training in all; ``sizes``: the round's prompts, samples per prompt,
    micro-batch and new tokens. Arms: ``trl`` (plain HF ``generate``), ``trl_vllm`` (generation on vLLM in TRL's
    process: ``vllm_mode="colocate"``, TRL's fast path, its other vLLM settings at their defaults), ``trl_reset``
    (AdamW's moments cleared at every round boundary, as batchrl's policy_checkpoint starts each RL iteration with a
    fresh optimiser: does that reset explain a held-out accuracy gap?)."""
    if TASK.get("lora"):
        raise ValueError(f"{arm}: the TRL arms train full weights; run them with a full-weight --gsm8k-profile "
                         "(gsm8k, gsm8k-1.5b), beside the bench's own lora arm")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from batchrl.training.rewards.registry import get_reward_function

    round_prompts, samples_per_prompt, micro_batch, new_tokens = sizes
    out_dir, progress_path = os.path.join(state, f"{arm}_out"), os.path.join(state, f"{arm}_progress.json")
    if resume:
        if not os.path.exists(progress_path):
            raise SystemExit(f"more:{arm}: no earlier call of {arm} left its progress in {progress_path}")
        with open(progress_path) as f:
            progress = json.load(f)
        if progress.get("seed", seed) != seed:
            raise SystemExit(f"more:{arm}: its run so far has seed {progress['seed']}, not --seed {seed}")
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        progress = {"wall_s": 0.0, "setup_s": 0.0, "calls": 0, "curve": {}, "checkpoint": None, "seed": seed}
    rows = task_prompts("train")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
                              for r in rows])
    rule = get_reward_function(TASK["reward"])

    def reward(completions, answer, **_):  # the same rule batchrl's rewards stage scores with
        return [rule("", c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    steps_per_round = round_prompts * samples_per_prompt // micro_batch
    state_dir, reset_optimizer = state, arm == "trl_reset"  # the callback's own `state` is TRL's TrainerState
    clock = {"saves_s": 0.0}
    curve = dict(progress["curve"])

    def save_policy(model, folder: str) -> None:  # in the dtype the bench's evaluation loads it in (bf16 on the GPU:
        dtype = torch.bfloat16 if bf16 else torch.float32  # half the disk of fp32, 3.5 GB at 1.5B)
        model.save_pretrained(folder, state_dict={k: v.to(dtype) for k, v in model.state_dict().items()})
        tokenizer.save_pretrained(folder)

    def trained_s() -> float:  # this call's training time, curve saves off, plus the earlier calls'
        return progress["wall_s"] + time.monotonic() - clock["start"] - clock["saves_s"]

    class StopAfter(TrainerCallback):  # at the first round boundary after the budget
        def on_step_end(self, args, state, control, **kwargs):
            rounds = state.global_step // steps_per_round
            if curve_every and state.global_step % steps_per_round == 0 and rounds % curve_every == 0:
                saved = time.monotonic()  # a curve point, off the clock (batchrl publishes every policy anyway)
                folder = os.path.join(state_dir, f"{arm}_curve", str(rounds))
                save_policy(kwargs["model"], folder)
                curve[str(rounds)] = folder
                clock["saves_s"] += time.monotonic() - saved
            if state.global_step % steps_per_round == 0 and trained_s() > 60 * minutes:
                clock["trained_s"] = trained_s()
                control.should_training_stop = True
                control.should_save = True  # off the clock: what a later call (more:ARM) goes on from
                if progress["checkpoint"]:  # the one this call resumed from, read long ago: its GBs make room for it
                    shutil.rmtree(progress["checkpoint"], ignore_errors=True)
            if reset_optimizer and state.global_step % steps_per_round == 0:
                kwargs["optimizer"].state.clear()  # the next step starts AdamW afresh, as a new batchrl job does

    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.35) if arm == "trl_vllm" else {}
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=micro_batch,
        num_generations=samples_per_prompt, steps_per_generation=steps_per_round, max_completion_length=new_tokens,
        temperature=1.0, learning_rate=TASK["lr"], lr_scheduler_type="constant", beta=TASK["beta"], bf16=bf16,
        # TRL's default is on; off is faster at 0.5B (its best there), and at 1.5B with micro-batch 16 it is CUDA OOM
        # on an 80 GB H100 beside vLLM's 35% (2026-12-06): on there (the task's trl_checkpointing;
        # BENCH_TRL_CHECKPOINTING=0/1 overrides)
        gradient_checkpointing=os.environ.get("BENCH_TRL_CHECKPOINTING", str(int(TASK.get("trl_checkpointing",
                                                                                          False)))) == "1",
        max_steps=steps_per_round * 1000, logging_steps=steps_per_round, save_strategy="no", report_to="none",
        seed=seed, dataloader_num_workers=0, **vllm)
    built = time.monotonic()  # TRL's model and (vllm) engine builds: off its clock, reported as setup_s
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StopAfter()])
    clock["start"] = time.monotonic()
    setup_s = clock["start"] - built
    trainer.train(resume_from_checkpoint=progress["checkpoint"])
    wall = clock.get("trained_s", trained_s())
    rounds = trainer.state.global_step // steps_per_round
    folder = curve.get(str(rounds))  # the last curve point is the final policy: no second copy
    if folder is None:
        folder = os.path.join(state, f"{arm}_final")
        save_policy(trainer.model, folder)
    checkpoints = sorted((d for d in os.listdir(out_dir) if d.startswith("checkpoint-")),
                         key=lambda d: int(d.split("-")[1])) if os.path.isdir(out_dir) else []
    for older in checkpoints[:-1]:  # weights and AdamW's moments in fp32, GBs each: the last one is enough
        shutil.rmtree(os.path.join(out_dir, older))
    progress.update(wall_s=wall, setup_s=progress["setup_s"] + setup_s, calls=progress["calls"] + 1, curve=curve,
                    checkpoint=os.path.join(out_dir, checkpoints[-1]) if checkpoints else None)
    with open(progress_path, "w") as f:
        json.dump(progress, f)
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    samples = rounds * round_prompts * samples_per_prompt
    return {"wall_s": round(wall, 1), "setup_s": round(progress["setup_s"], 1), "calls": progress["calls"],
            "rounds": rounds, "base": base, "optimizer_steps": trainer.state.global_step, "samples": samples,
            "samples_per_s": round(samples / wall, 1), "mean_iteration_s": round(wall / max(rounds, 1), 2),
            "curve": curve, "curve_saves_s": round(clock["saves_s"], 1),
            "train_reward_first_last": [rewards[0], rewards[-1]] if rewards else None, "policy": folder,
            "config": {"loss_type": config.loss_type, "scale_rewards": config.scale_rewards,
                       "gradient_checkpointing": config.gradient_checkpointing,
                       "generation_batch_size": config.generation_batch_size}}
