"""A storage root copied with its Dagster home is a root of its own (issue 29 item 6, issue 33): in the copy,
`batchrl audit` (by asset name, by artifact folder, --used-file), `batchrl reproduce` by asset name and a
further RL iteration that loads its inputs through the IO manager all read the copy. The original is deleted
before any of them runs, so a command that still reached it would fail, and nothing may recreate it."""
from __future__ import annotations

import json
import shutil

import dagster as dg
import pytest
import yaml
from pipeline_helpers import RL_LOOP, UPSTREAM, latest_metadata, local_resources, recipe, run_assets

from batchrl.cli.instance import write_instance_settings
from batchrl.cli.main import main

# what one RL iteration reads: at the default reward mix (reward model weight 0) no reward model, whose training job
# was the fixture's one trainer job besides the policy update's, and which no command here reads
TINY = {"ops": {"base_model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1}},
                "rollouts": {"config": {"max_prompts": 4}}}, "resources": recipe(samples_per_prompt=2)}


@pytest.fixture
def copied_root(tmp_path, monkeypatch):
    """One RL iteration on the tiny model in ``original/`` (storage root + Dagster home), copied to ``copy/``,
    the original deleted; the CLI's environment points at the copy. ~35 s on 2 cores."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    (original / "home").mkdir(parents=True)
    write_instance_settings(str(original / "home"))  # the home `batchrl run` makes
    with dg.DagsterInstance.local_temp(str(original / "home")) as instance:
        assert run_assets(local_resources(str(original / "storage")), instance, UPSTREAM + RL_LOOP, TINY).success
        checkpoint = latest_metadata(instance, "policy_checkpoint")
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(copy / "home"))
    monkeypatch.setenv("BATCHRL_STORAGE", str(copy / "storage"))
    monkeypatch.setenv("BATCHRL_ENV", "local")
    monkeypatch.delenv("BATCHRL_PROFILE", raising=False)
    monkeypatch.setenv("BATCHRL_DPO_SELF_PLAY", "")  # _run_config may set it; setenv records the undo
    yield original, copy, checkpoint
    assert not original.exists(), "a command in the copy wrote to the original root"


def _cli(capfd, *argv: str) -> str:
    code = main(list(argv))
    out, err = capfd.readouterr()
    assert code == 0, f"batchrl {' '.join(argv)} exited {code}:\n{out}\n{err}"
    return out


def test_a_copied_root_with_its_home_audits_reproduces_and_runs_the_next_iteration(copied_root, tmp_path, capfd):
    original, copy, checkpoint = copied_root
    storage = copy / "storage"
    folder = storage / "policy_checkpoint" / checkpoint["data_version"]

    by_name = json.loads(_cli(capfd, "audit", "policy_checkpoint", "--json"))
    assert by_name["uri"] == str(folder)
    assert by_name["inputs"]["advantages"]["uri"].startswith(f"{storage}/advantages/")
    by_folder = json.loads(_cli(capfd, "audit", str(folder), "--json"))
    assert by_folder == by_name
    assert str(original) not in json.dumps(by_name)

    used = json.loads(_cli(capfd, "audit", "--used-file", "train.jsonl", "--json"))  # the arithmetic prompts
    assert [row["uri"] for row in used if row["asset"] == "policy_checkpoint"] == [str(folder)]
    assert all(row["uri"].startswith(f"{storage}/") for row in used)

    rollouts = latest_metadata_in_copy("rollouts")
    _cli(capfd, "reproduce", "rollouts", "--to", str(tmp_path / "fresh"))
    assert (tmp_path / "fresh" / "rollouts" / rollouts).is_dir()

    # the next iteration: rollouts load the promoted checkpoint, the others their upstreams, all from the copy
    config = tmp_path / "next.yaml"  # three samples a prompt: new rollouts (the same ones would be deduplicated)
    config.write_text(yaml.safe_dump({"ops": {"rollouts": {"config": {"max_prompts": 4}}},
                                      "resources": {"rl_recipe": {"samples_per_prompt": 3}}}))
    _cli(capfd, "run", "--select", ",".join(RL_LOOP), "-c", str(config), "--concurrent-steps", "1")
    sampled = json.loads(_cli(capfd, "audit", "rollouts", "--json"))
    assert sampled["uri"].startswith(f"{storage}/rollouts/") and sampled["data_version"] != rollouts
    assert sampled["inputs"]["policy"]["uri"] == str(folder)  # from the copied checkpoint, promoted in the copy


def latest_metadata_in_copy(asset: str) -> str:
    """The data version of ``asset``'s latest materialisation in the copied Dagster home (DAGSTER_HOME)."""
    with dg.DagsterInstance.get() as instance:
        return latest_metadata(instance, asset)["data_version"]
