"""Tool-using rollouts through the RL assets (issue 35): one Dagster run of prompts → rollouts → rewards →
advantages → policy_checkpoint on the tool task (sample_data/tools) with the tiny model with forced tokens
(tests/helpers_agent.py: three sandboxed cells, then the answer), in the Dagster process."""
from __future__ import annotations

import os

import dagster as dg
import pandas as pd
import pytest
from helpers_agent import ForcedEngine
from pipeline_helpers import RL_LOOP, UPSTREAM, latest_metadata, local_resources, run_assets

from batchrl.resources.rl_recipe import RLRecipe

from batchrl.resources import LandingResource, RolloutEngineResource
from batchrl.schemas.trajectory import check_trajectories
from batchrl.training.rollout import ROLLOUT_ENGINES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL_TASK = {  # the README's tool-task config, at the tiny model's size
    "base_model": {"config": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}},
    "rollouts": {"config": {"max_prompts": 2,
                            "agent": {"tool_format": "python_block", "max_turns": 4, "max_total_tokens": 800}}},
    "rewards": {"config": {"rule": "final_answer"}},
    "policy_checkpoint": {"config": {"micro_batch_size": 4, "grad_accum": 1, "ppo_epochs": 1}},
}


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_graph")
    (root / "home").mkdir()
    ROLLOUT_ENGINES["forced"] = ForcedEngine
    tools = os.path.join(REPO, "sample_data", "tools")
    landing = LandingResource(prompts=os.path.join(tools, "train.jsonl"),
                              eval_prompts=os.path.join(tools, "heldout.jsonl"))
    resources = local_resources(str(root / "storage"), landing=landing,
                                rollout_engine=RolloutEngineResource(kind="forced", max_new_tokens=160),
                                rl_recipe=RLRecipe(estimator="grpo", samples_per_prompt=2))
    try:
        with dg.DagsterInstance.local_temp(str(root / "home")) as instance:
            result = run_assets(resources, instance, UPSTREAM + RL_LOOP, {"ops": TOOL_TASK})
            assert result.success
            yield {**{asset: latest_metadata(instance, asset) for asset in RL_LOOP},
                   "instance": instance, "resources": resources}
    finally:
        ROLLOUT_ENGINES.pop("forced", None)


def test_the_rl_chain_trains_on_tool_trajectories(tool_run):
    rollouts, rewards, advantages, checkpoint = (tool_run[a] for a in RL_LOOP)
    assert rollouts["mean_tool_calls"] == 3.0 and rollouts["finish/stop"] == 1.0 and rollouts["tool_error_rate"] == 0.0
    assert 0.0 < rollouts["tool_share"] < 1.0
    # the sandbox the calls ran in, named with each piece in force (issue 51)
    assert rollouts["sandbox/level"] in ("bwrap", "namespaces") and rollouts["sandbox/boundary"] is True
    assert rollouts["sandbox/landlock"] and rollouts["sandbox/seccomp"] and rollouts["sandbox/rlimits"]
    shown = rollouts["example_trajectory"]  # one trajectory in the UI (Markdown), turn by turn
    assert shown.count("status ok, exit_code 0") == 3 and "finish_reason **stop**, 3 tool calls" in shown
    assert rewards["mean_reward"] == 1.0  # every forced trajectory reads its answer off the sandbox
    assert advantages["samples"] == 4 and checkpoint["iteration"] == 1
    assert isinstance(checkpoint["global_step"], int) and checkpoint["global_step"] >= 1


def test_the_published_rollouts_keep_every_turn_and_the_advantages_skip_observations(tool_run):
    table = pd.read_parquet(os.path.join(tool_run["rollouts"]["uri"], "rollouts.parquet"))
    assert check_trajectories(table.to_dict("records")) == 4
    assert {"answer", "category", "turns", "loss_mask"} <= set(table.columns)
    statuses = [t["status"] for turns in table["turns"] for t in turns if t["role"] == "user"]
    assert statuses == ["ok"] * 12
    batch = pd.read_parquet(os.path.join(tool_run["advantages"]["uri"], "advantages.parquet"))
    for adv, mask in zip(batch["advantages"], batch["loss_mask"]):
        assert len(adv) == len(mask) and all(a == 0.0 for a, m in zip(adv, mask) if not m)


def test_the_rollouts_job_in_its_own_process_runs_the_agent_too(tool_run):
    """The GPU environments sample in a Pipes job (in_subprocess): the agent config travels with it. The real tiny
    model there (no forced tokens in another process): it writes no tool call, so one-turn trajectories."""
    resources = {**tool_run["resources"],
                 "rollout_engine": RolloutEngineResource(kind="transformers", max_new_tokens=16, in_subprocess=True)}
    assert run_assets(resources, tool_run["instance"], ["rollouts"], {"ops": TOOL_TASK}).success
    rollouts = latest_metadata(tool_run["instance"], "rollouts")
    assert rollouts["mean_turns"] == 1.0 and rollouts["finish/length"] + rollouts["finish/stop"] == 1.0
    table = pd.read_parquet(os.path.join(rollouts["uri"], "rollouts.parquet"))
    assert check_trajectories(table.to_dict("records")) == 4
    system = table["prompt_ids"][0]  # the tool instructions went in as the system turn
    assert "You can run Python" in _decode(tool_run, system)


def _decode(tool_run, ids) -> str:
    from batchrl.training.models.loading import load_tokenizer

    return load_tokenizer(tool_run["rollouts"]["policy"]).decode(list(ids))
