"""How far a new AdamW per RL iteration moves the weights against one AdamW over the run (CPU, minutes).

batchrl's policy update is a job per RL iteration; without ``carry_optimizer_state`` each starts a new AdamW, so its
first step moves every weight by ~lr (m / sqrt(v) = g / |g| after bias correction) and its moments are estimated
from the iteration's few steps, where a run-long AdamW (TRL's, verl's) has averaged the gradient's noise over
hundreds. This measures the size of each optimiser step, ||dW|| / (lr sqrt(n)) (1.0: every weight moved by lr), on
the tiny model under noisy gradients (language-model loss on random tokens, a new batch each step: noise dominates,
as in policy gradients), with the chain of update jobs simulated as the trainer does it: ``--iterations`` x
``--steps`` steps, the optimiser new at each iteration or carried through ``optimizer_state.save``/``load``.

    python bench/check_optimizer_carry.py --out bench/results/optimizer_carry_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from batchrl.training.models.loading import load_model_and_tokenizer

from batchrl.training.models.tiny import build_tiny_model
from batchrl.training.trainer import optimizer_state
from batchrl.training.trainer.config import PolicyConfig
from batchrl.training.trainer.engine import make_optimizer


def step_sizes(base: str, carry: bool, iterations: int, steps: int, lr: float, seed: int = 0) -> list[float]:
    """Each optimiser step's ||dW|| / (lr sqrt(n)) over the chain of iterations."""
    cfg = PolicyConfig(lr=lr)
    model, _ = load_model_and_tokenizer(base)
    n = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(seed)
    sizes = []
    with tempfile.TemporaryDirectory() as state:
        for iteration in range(iterations):
            optimizer = make_optimizer(model, cfg)  # each iteration's job builds its own
            if carry and iteration:
                optimizer_state.load(optimizer, model, state)
            for _ in range(steps):
                before = [p.detach().clone() for p in model.parameters()]
                ids = torch.randint(3, 200, (4, 16), generator=generator)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                moved = sum(float((p.detach() - b).square().sum()) for p, b in zip(model.parameters(), before))
                sizes.append(moved ** 0.5 / (lr * n ** 0.5))
            if carry:
                optimizer_state.save(optimizer, model, state)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="optimiser steps per iteration (the real profile's 24)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as root:
        base = os.path.join(root, "base")
        build_tiny_model(["12 + 7 = 19", "3 * 4 = 12"], base, seed=0, hidden_size=64, intermediate_size=128)
        runs = {name: step_sizes(base, name == "carried", args.iterations, args.steps, args.lr)
                for name in ("new_each_iteration", "carried")}
    per_iteration = {name: [round(sum(sizes[i * args.steps:(i + 1) * args.steps]) / args.steps, 3)
                            for i in range(args.iterations)] for name, sizes in runs.items()}
    first_steps = {name: [round(sizes[i * args.steps], 3) for i in range(args.iterations)]
                   for name, sizes in runs.items()}
    report = {"what": "||dW|| / (lr sqrt(n)) per optimiser step: mean per iteration, and each iteration's first step",
              "iterations": args.iterations, "steps_per_iteration": args.steps, "lr": args.lr,
              "mean_step_per_iteration": per_iteration, "first_step_of_each_iteration": first_steps,
              "seconds": round(time.time() - started, 1)}
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
