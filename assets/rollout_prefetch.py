"""Rollouts sampled before their step asks (issue 32): one-step off-policy prefetch (verl's ``one_step_off_policy``,
AReaL's bounded staleness), and the request of on-policy sampling ahead (``training/rollout/ahead.py``).

With ``rollouts.off_policy_steps: 1`` an iteration's rollouts are, by definition, sampled from the promoted policy's
parent — the policy one update behind — with the iteration's seed and prompt subset: a function of published
artifacts and config, whoever computes it. That is what lets them be computed early: the iteration before, right
after its own rollouts, hands the next iteration's request (its promoted policy, which is the next one's parent; the
seed the run announced for it, ``NEXT_ROLLOUTS_SEED_TAG``; none announced, nothing is sampled ahead) to the job
worker's rollouts worker, which samples it while this iteration's rewards, advantages and update run. The next
iteration's rollouts step asks that worker for the same request with the folder it was handed: the worker answers
after the prefetch (it runs one job at a time), and the job takes the finished samples instead of sampling. A
request that differs (another seed, prompts, policy or engine), a prefetch that failed or a worker that was
restarted is sampled then and there: the same samples, later.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import pandas as pd

from batchrl.common.prefetch_key import FOLDER, request_folder, request_parts
from batchrl.resources import RolloutEngineResource, StorageResource, TrainerLauncherResource
from batchrl.resources.artifacts import Artifact, make_local
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.training.data.text import prompt_messages

PROMPTS_FILE = "prompts.parquet"  # the prompts asset's table
# a run's tag: the rollouts seed of the RL iteration that follows it (`batchrl run --rl-iterations N` sets it)
NEXT_ROLLOUTS_SEED_TAG = "batchrl/next_rollouts_seed"
# why nothing was sampled ahead (rollouts' `prefetch`, the policy update's `sample_ahead` metadata)
NO_NEXT_ITERATION = "off: no next RL iteration announced in this run (batchrl run --rl-iterations N announces them)"
NO_PREFETCH_WORKER = ("off: sampling ahead needs the rollouts in the job worker (trainer.backend worker, or ray "
                      "with resident node workers, one rank and one rollout replica; rollout_engine.in_subprocess, "
                      "an engine other than vLLM)")
STALE_S = 3600.0  # a prefetch nobody took within an hour is removed when the next one starts


@dataclass(frozen=True)
class SamplingRequest:
    policy: Artifact  # the policy sampled from
    prompts: list[str]
    messages: list | None
    n: int
    seed: int
    agent: dict | None


def announced_next_seed(tags: dict) -> int | None:
    """The rollouts seed of the RL iteration after this run's, or None where the run announced none (a run from the
    UI, a sensor's, the last of `batchrl run`'s iterations): then nothing is sampled ahead for nobody to take."""
    return int(tags[NEXT_ROLLOUTS_SEED_TAG]) if NEXT_ROLLOUTS_SEED_TAG in tags else None


def prompt_subset(table: pd.DataFrame, max_prompts: int | None, seed: int) -> pd.DataFrame:
    """The iteration's prompts: all of them, or a sample of ``max_prompts`` drawn with ``seed``."""
    if max_prompts and len(table) > max_prompts:
        return table.sample(max_prompts, random_state=seed).sort_index()
    return table


def _folder(root: str, engine: RolloutEngineResource, request: SamplingRequest) -> str:
    return request_folder(root, request_parts(
        request.policy.asset, request.policy.data_version, request.prompts, request.messages, request.n,
        request.seed, request.agent, engine.model_dump()))


def remove_stale(storage: StorageResource) -> None:
    """Prefetches never taken (the next request differed), an hour after they were handed out."""
    root = os.path.join(storage.cache_dir, FOLDER)
    if os.path.isdir(root):
        for name in os.listdir(root):
            if time.time() - os.path.getmtime(os.path.join(root, name)) > STALE_S:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prefetched_folder(storage: StorageResource, engine: RolloutEngineResource, launcher: TrainerLauncherResource,
                      request: SamplingRequest) -> str | None:
    """The folder a prefetch or a sampling ahead of exactly this request was handed (finished or still sampling),
    else None. Where the update samples ahead into the cache of a Ray node (not a path here), the place it would
    be on the node that takes the job: the job takes the samples if its node has them, else samples itself."""
    folder = _folder(os.path.join(storage.cache_dir, FOLDER), engine, request)
    if os.path.isdir(folder):
        return folder
    root = launcher.ahead_root(storage.cache_dir)
    return _folder(root, engine, request) if root is not None and not os.path.isabs(root) else None


def start_prefetch(storage: StorageResource, engine: RolloutEngineResource, launcher: TrainerLauncherResource,
                   request: SamplingRequest) -> int:
    """Hand ``request`` to the rollouts worker, which samples it while the run goes on; returns the worker's pid."""
    remove_stale(storage)
    folder = _folder(os.path.join(storage.cache_dir, FOLDER), engine, request)
    shutil.rmtree(folder, ignore_errors=True)
    return engine.prefetch(launcher, model_path=request.policy.path, prompts=request.prompts, n=request.n,
                           seed=request.seed, folder=folder, cache_dir=storage.cache_dir, messages=request.messages,
                           agent=request.agent)


def sample_ahead_request(storage: StorageResource, engine: RolloutEngineResource, launcher: TrainerLauncherResource,
                         rollouts: Artifact, parent: Artifact, asset: str, tags: dict,
                         recipe: RLRecipe) -> tuple[dict | None, str]:
    """``(request, why)``: the next iteration's rollouts request, for the update of ``rollouts`` (trained from
    ``parent``, published as ``asset``, in a run of ``tags``) to sample from its new weights while it exports them —
    the request the next rollouts step makes with the seed the run announced (``NEXT_ROLLOUTS_SEED_TAG``), the
    recipe's samples per prompt and the rollouts' own prompt sample and agent — or None where the recipe does not
    sample ahead, no next iteration is known or its step could not take them."""
    if not recipe.sample_ahead:
        return None, "off"
    config = rollouts.lineage.get("config", {})
    root = launcher.ahead_root(storage.cache_dir) if engine.samples_in_job_worker() else None
    if root is None:
        return None, NO_PREFETCH_WORKER
    seed = announced_next_seed(tags)
    if seed is None:
        return None, NO_NEXT_ITERATION
    prompts_table = make_local(storage, rollouts.input_ref("prompts"), files={"table": PROMPTS_FILE}).read_table()
    table = prompt_subset(prompts_table, config.get("max_prompts"), seed)
    prompts, messages = list(table["prompt"]), prompt_messages(table.to_dict("records"))
    n, agent = recipe.samples_per_prompt, config.get("agent")
    remove_stale(storage)
    return {"engine": engine.engine_options(parent.path, storage.cache_dir), "prompts": prompts,
            "messages": messages, "n": n, "seed": seed, "agent": agent,
            "root": root,
            "key_parts": request_parts(asset, None, prompts, messages, n, seed, agent, engine.model_dump())}, "started"
