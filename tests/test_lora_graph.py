"""LoRA through the asset graph (issue 30): the reward model and policy checkpoints are adapter artifacts whose
data version is the adapter's content hash and whose lineage names the base model's version; the policy chain
(promoted_policy -> rollouts -> next update) carries adapters; rewards score with the reward model's adapter.
(DPO, evaluation and the other consumers on base + adapter: tests/test_lora.py, without Dagster: the graph run
is the suite's cost, ~1 min here.)"""
import os

import dagster as dg
import pytest

from pipeline_helpers import latest_metadata, local_resources, recipe, run_assets

from batchrl.common import fsutil
from batchrl.resources import StorageResource
from batchrl.training.models import lora

DATA = ["raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
        "prompts", "base_model"]
RL = ["rollouts", "rewards", "advantages", "policy_checkpoint"]
LORA = {"lora_rank": 4, "lora_alpha": 8}
RECIPE = {"resources": recipe(samples_per_prompt=3)}
OPS = {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
       "reward_model": {"config": {"epochs": 1, **LORA}},
       "rollouts": {"config": {"max_prompts": 6}},
       "rewards": {"config": {"weights": {"rule": 1.0, "reward_model": 0.5}}},  # the RM adapter scores too
       "policy_checkpoint": {"config": {"micro_batch_size": 18, **LORA}}}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """The graph with LoRA, then a second RL iteration (from the promoted adapter)."""
    root = str(tmp_path_factory.mktemp("storage"))
    with dg.DagsterInstance.local_temp(str(tmp_path_factory.mktemp("home"))) as instance:
        first = run_assets(local_resources(root), instance, DATA + ["reward_model"] + RL, {"ops": OPS, **RECIPE})
        assert first.success
        promoted_first = latest_metadata(instance, "policy_checkpoint")
        ops = {**OPS, "rollouts": {"config": {**OPS["rollouts"]["config"], "seed": 1}}}
        second = run_assets(local_resources(root), instance, RL, {"ops": ops, **RECIPE})
        assert second.success
        yield instance, root, promoted_first


def _artifact(instance, root, asset, meta=None):
    meta = meta or latest_metadata(instance, asset)
    ref = {"asset": asset, "uri": meta["uri"], "data_version": meta["data_version"]}
    return meta, StorageResource(root=root).read_lineage(ref)


def test_checkpoints_are_adapters_versioned_by_their_content_and_naming_their_base(graph):
    instance, root, _ = graph
    base = latest_metadata(instance, "base_model")
    base_bytes = os.path.getsize(os.path.join(base["uri"], "model.safetensors"))
    for asset, base_input in (("reward_model", "base_model"), ("policy_checkpoint", "reference")):
        meta, lineage = _artifact(instance, root, asset)
        folder = meta["uri"]
        assert lora.is_adapter_folder(folder), asset
        assert {n for n in os.listdir(folder) if n not in fsutil.RECORD_FILES} == {lora.ADAPTER_CONFIG,
                                                                                     lora.ADAPTER_WEIGHTS}
        assert lora.adapter_bytes(folder) < base_bytes / 5
        # the data version is the adapter's content hash (the records beside it are not part of it)
        local = fsutil.filesystem_for(folder)[0]
        assert fsutil.sha256_tree(local, folder).startswith(meta["data_version"]) or \
            meta["content_hash"].startswith(meta["data_version"])
        assert lineage["inputs"][base_input]["data_version"] == base["data_version"]
        assert meta["adapter_base"] == f"base_model/{base['data_version']}"
        assert lora.read_adapter_config(folder)["base_model_name_or_path"] == meta["adapter_base"]
        assert lora.adapter_base(folder) == base["uri"]


def test_the_policy_chain_carries_adapters(graph):
    instance, root, first = graph
    meta, lineage = _artifact(instance, root, "policy_checkpoint")
    assert meta["data_version"] != first["data_version"]
    assert lineage["inputs"]["policy"]["data_version"] == first["data_version"]  # trained from the first adapter
    assert lineage["config"]["model_path"].startswith("policy_checkpoint/")
    _, rollouts = _artifact(instance, root, "rollouts")
    assert rollouts["inputs"]["policy"]["data_version"] == first["data_version"]  # sampled from base + adapter
    event = instance.get_latest_materialization_event(dg.AssetKey("promoted_policy"))
    assert event.asset_materialization.tags["dagster/data_version"] == meta["data_version"]


def test_rewards_are_scored_by_the_reward_models_adapter(graph):
    instance, root, _ = graph
    meta, lineage = _artifact(instance, root, "rewards")
    assert lineage["inputs"]["reward_model"]["data_version"] == latest_metadata(instance, "reward_model")["data_version"]
    assert meta["samples"] == 18
