"""On-policy sampling ahead (the RL recipe's ``sample_ahead``, issue 32; training/rollout/ahead.py): the policy update
samples the next iteration's rollouts from the weights it has just trained while it exports and hashes them, and the next
rollouts step takes those samples. They are the samples that step would draw itself from the published checkpoint.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from pipeline_helpers import recipe, seeded_rl_iterations, stop_workers

from batchrl.assets.rollout_prefetch import (
    NEXT_ROLLOUTS_SEED_TAG, PROMPTS_FILE, SamplingRequest, prefetched_folder, prompt_subset, sample_ahead_request,
)
from batchrl.common.prefetch_key import AHEAD_MARK, FOLDER, STATS_FILE, request_folder
from batchrl.common.storage_layout import cache_dir_of
from batchrl.resources import RolloutEngineResource, StorageResource, TrainerLauncherResource, ray_staging
from batchrl.resources.ray_launch import RayJobs
from batchrl.resources.artifacts import Artifact
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.training.rollout.sampling_job import sample_to_parquet
from batchrl.training.data.text import prompt_messages

AHEAD = {"ops": {  # on the upstream assets of the `upstream_copy` fixture (pipeline_helpers.TINY_BASE)
    "rollouts": {"config": {"max_prompts": 8}},
    "rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.0}}},
    "policy_checkpoint": {"config": {"micro_batch_size": 4, "lr": 1.0e-3}},
}, "resources": recipe(samples_per_prompt=2, sample_ahead=True)}
ITERATIONS = 3
NO_NEXT = "off: no next RL iteration announced in this run (batchrl run --rl-iterations N announces them)"
LORA = {**AHEAD, "ops": {**AHEAD["ops"], "policy_checkpoint": {"config": {
    "micro_batch_size": 4, "lora_rank": 4, "lora_alpha": 8, "lr": 1.0e-3}}}}


def _left_incomplete(root: str):
    """Before iteration 3 (seed 2): the update's samples for it as a job that died while sampling leaves them (its
    folder marked, with no statistics and a pid that is gone)."""
    def before(seed: int) -> None:
        if seed == 2:
            for mark in glob.glob(os.path.join(cache_dir_of(root), FOLDER, "*", AHEAD_MARK)):
                os.remove(os.path.join(os.path.dirname(mark), STATS_FILE))
                with open(mark, "w") as f:
                    f.write(f'{{"pid": {_gone_pid()}}}')
    return before


@pytest.mark.parametrize("run_config", [AHEAD, LORA], ids=["full_weights", "lora_adapter"])
def test_rollouts_sampled_ahead_by_the_update_are_the_ones_the_next_step_would_sample(tmp_path, upstream_copy,
                                                                                      run_config):
    """Full weights: copied from the trainer into the kept engine before the export; a LoRA adapter: merged into the
    engine's base from its export. Either way the samples are those of the published checkpoint; a sampling ahead
    cut short (its job killed) is sampled again by the rollouts step, with the same result."""
    root, home = upstream_copy(tmp_path)
    history = {"ahead": seeded_rl_iterations(root, home, run_config, ITERATIONS, rollouts_in_worker=True,
                                             env={"BATCHRL_WEIGHT_CACHE_GB": "1"}, before=_left_incomplete(root))}
    ahead = history["ahead"]
    try:
        # each update with a next iteration announced sampled it (its seed) from its new weights; iteration 2 took
        # those samples, iteration 3 found them cut short and sampled itself; the last run announced none
        assert [m["sample_ahead"] for m in ahead["policy_checkpoint"]] == ["started", "started", NO_NEXT]
        assert [m.get("sample_ahead_seed") for m in ahead["policy_checkpoint"]] == ["1", "2", None]  # text: no plot
        assert [m["prefetched"] for m in ahead["rollouts"]] == [False, True, False]
        assert [m["sampled_ahead"] for m in ahead["rollouts"]] == [False, True, False]
        assert ahead["rollouts"][1]["sample_ahead_s"] > 0
        assert all(m["staleness"] == 0 for m in ahead["rollouts"])  # on-policy: the promoted checkpoint's samples
        # nothing was sampled for an iteration that was not coming
        assert not glob.glob(os.path.join(cache_dir_of(root), FOLDER, "*", AHEAD_MARK))
    finally:
        stop_workers(history)
    # iterations 2 and 3's samples are those a rollouts step draws itself, in the Dagster process, from the published
    # checkpoint's files (not the trainer's weights): same prompts, tokens and log-probs
    for seed in (1, 2):
        taken = _table(root, "rollouts", ahead["rollouts"][seed]["data_version"])
        policy = os.path.join(root, "policy_checkpoint", ahead["policy_checkpoint"][seed - 1]["data_version"])
        again = _sampled_in_process(root, policy, seed, str(tmp_path / f"again{seed}.parquet"))
        assert len(taken) == len(again) == 16
        for column in ("prompt_index", "sample_index", "response", "finish_reason"):
            assert taken[column].tolist() == again[column].tolist(), column
        assert [list(ids) for ids in taken["response_ids"]] == [list(ids) for ids in again["response_ids"]]
        assert np.allclose(np.concatenate(list(taken["rollout_logprobs"])),
                           np.concatenate(list(again["rollout_logprobs"])), atol=1e-5)


def _gone_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def _sampled_in_process(root: str, policy: str, seed: int, out: str) -> pd.DataFrame:
    prompts = prompt_subset(_table(root, "prompts"), 8, seed=seed)
    sample_to_parquet(RolloutEngineResource().engine_options(policy, os.path.dirname(out)), list(prompts["prompt"]),
                      n=2, seed=seed, out_parquet=out, messages=prompt_messages(prompts.to_dict("records")))
    return pd.read_parquet(out)


def _table(root: str, asset: str, data_version: str = "*") -> pd.DataFrame:
    (path,) = glob.glob(os.path.join(root, asset, data_version, f"{asset}.parquet"))
    return pd.read_parquet(path)


def test_sample_ahead_is_off_where_the_rollouts_are_not_in_the_job_worker():
    """In the Dagster process nothing could take the samples: the update is not asked, and its metadata says why."""
    rollouts = Artifact("rollouts", "file:///r", "0" * 16, lineage={"config": {}})
    following = {NEXT_ROLLOUTS_SEED_TAG: "1"}
    request, why = sample_ahead_request(None, RolloutEngineResource(in_subprocess=False),
                                        TrainerLauncherResource(backend="worker"), rollouts, rollouts, "policy",
                                        following, RLRecipe(sample_ahead=True))
    assert request is None and why.startswith("off: sampling ahead needs the rollouts in the job worker")
    assert sample_ahead_request(None, RolloutEngineResource(in_subprocess=True), TrainerLauncherResource(
        backend="worker"), rollouts, rollouts, "policy", following, RLRecipe()) == (None, "off")  # the recipe's


def test_under_ray_the_samples_drawn_ahead_wait_in_the_nodes_cache_where_the_next_rollouts_job_looks(tmp_path):
    """One rank, one rollout replica, resident node workers: the update's request names the cache of the node it
    runs on, and the next rollouts step names the same folder there (the rank resolves both on its node); with
    several ranks or replicas, or a fresh process per job, nothing is sampled ahead and nothing is looked for."""
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))
    staging = tmp_path / "staging"
    staging.mkdir()
    frame = pd.DataFrame({"prompt": [f"What is {i} + 2?" for i in range(6)]})
    frame.to_parquet(staging / PROMPTS_FILE)
    prompts = storage.publish(str(staging), "prompts", {"config": {}})
    rollouts = Artifact("rollouts", "file:///r", "0" * 16, lineage={"config": {"max_prompts": 4},
                                                                     "inputs": {"prompts": prompts.to_dict()}})
    engine, ray = RolloutEngineResource(in_subprocess=True), RayJobs(world_size=1)
    launcher = TrainerLauncherResource(backend="ray", ray=ray)
    announced, wanted = {NEXT_ROLLOUTS_SEED_TAG: "3"}, RLRecipe(samples_per_prompt=2, sample_ahead=True)
    request, why = sample_ahead_request(storage, engine, launcher, rollouts, rollouts, "policy_checkpoint",
                                        announced, wanted)
    assert why == "started" and not os.path.isabs(request["root"])
    node = str(tmp_path / "node")
    on_node = ray_staging.resolve_node_cache(request, node)  # the update's config as its rank writes it
    policy = Artifact("policy_checkpoint", "file:///p", "ab" * 8, lineage={})  # its export, hashed and published
    drawn_into = request_folder(on_node["root"], on_node["key_parts"], policy.data_version)  # ahead.settle's
    table = prompt_subset(frame, 4, 3)
    asked = SamplingRequest(policy, list(table["prompt"]), prompt_messages(table.to_dict("records")), 2, 3, None)
    looked_for = prefetched_folder(storage, engine, launcher, asked)
    assert drawn_into.startswith(node + os.sep) and ray_staging.resolve_node_cache(looked_for, node) == drawn_into
    for update in ({"world_size": 2}, {"rollout_replicas": 2}, {"resident_worker_idle_s": 0}):
        other = TrainerLauncherResource(backend="ray", ray=ray.model_copy(update=update))
        off = sample_ahead_request(storage, engine, other, rollouts, rollouts, "policy_checkpoint", announced, wanted)
        assert off[0] is None and off[1].startswith("off: sampling ahead needs"), update
        assert prefetched_folder(storage, engine, other, asked) is None


def test_batchrl_run_announces_each_next_iteration_and_its_seed(tmp_path):
    """What a policy update samples ahead is the seed the CLI gives the next iteration; the last RL iteration (then
    the evaluation) announces none."""
    import argparse

    from batchrl.cli.run_command import _plan, announced_next
    from batchrl.definitions import build_definitions
    from pipeline_helpers import local_resources

    defs = build_definitions(local_resources(str(tmp_path / "s")))
    replicate = {"ops": {"rollouts": {"config": {"seed": 5000}}}}
    plan = _plan(defs, argparse.Namespace(select="*"), replicate, 3)
    assert [announced_next(plan, i).get(NEXT_ROLLOUTS_SEED_TAG) for i in range(len(plan))] == \
        ["5001", "5002", None, None]


@pytest.mark.parametrize("filled_by", ["a process that died", "this process's thread, which failed"])
def test_a_sampling_ahead_that_will_not_complete_is_not_waited_for(tmp_path, filled_by):
    """A folder marked as filled by an update's job that died before it completed it, or by this worker's own
    thread that failed: the rollouts job does not wait (it samples itself)."""
    from batchrl.training.jobs.rollouts import _wait_for_sampling_ahead

    pid = _gone_pid() if filled_by == "a process that died" else os.getpid()
    (tmp_path / AHEAD_MARK).write_text(f'{{"pid": {pid}}}')
    _wait_for_sampling_ahead(str(tmp_path))  # returns at once (a wait would take AHEAD_WAIT_S)
    assert not (tmp_path / STATS_FILE).exists()


def test_a_sampling_ahead_that_cannot_start_leaves_the_update_to_export(monkeypatch):
    """Starting the thread failed (e.g. the engine's build ran out of GPU memory beside the trainer): the update
    goes on to its export, says why nothing was sampled ahead, and keeps no engine the failure may have left
    half-loaded."""
    from types import SimpleNamespace

    from batchrl.training.rollout import ahead, resident
    from batchrl.training.trainer.policy import _start_sampling_ahead

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(ahead, "start", fail)
    monkeypatch.setattr(resident, "_kept", ({"kind": "static"}, object()))
    loop = SimpleNamespace(cfg=SimpleNamespace(zero_stage=0), engine=SimpleNamespace(module=None), lora_base=None)
    said = _start_sampling_ahead(loop, {"seed": 1})["sample_ahead"]
    assert said.startswith("off: it could not start (RuntimeError: CUDA out of memory)")
    assert resident._kept is None


@pytest.mark.parametrize("run_config, refused", [
    ({"resources": recipe(sample_ahead=True, off_policy_steps=1)}, "the off-policy rollouts are prefetched already"),
    ({"resources": recipe(sample_ahead=True), "ops": {"rollouts": {"config": {"policy": "base"}}}},
     "only policy: latest samples next"),
])
def test_sample_ahead_is_refused_where_nothing_could_take_its_samples(run_config, refused):
    from batchrl.assets.run_rules import check_run_config
    from batchrl.common.run_config_error import RunConfigError

    with pytest.raises(RunConfigError, match=refused):
        check_run_config(run_config)
