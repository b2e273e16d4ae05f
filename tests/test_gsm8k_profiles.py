"""The GSM8K profiles (issue 48): one base profile and variants that state only what differs (``extends``)."""
from __future__ import annotations

import re

import pytest

from batchrl.resources.profiles import ProfileError, load_profile
from batchrl.training.data.prompt_shapes import PromptQuarantine
from batchrl.training.data.prompts import load_prompts

PART = re.compile(r"^(?P<dist>[a-z0-9-]+?)(?P<n>\d+):(?P<module>[a-z0-9_]+?)(?P<m>\d+)/data/part(?P<k>\d{2})\.bin$")


@pytest.mark.parametrize("name,count,sha", [
    ("gsm8k", 6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    ("gsm8k-1.5b", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ("gsm8k-1.5b-lora", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")])
def test_each_profile_lists_its_parts_in_order_with_the_joined_hash(name, count, sha):
    config = load_profile(name, "gpu")["ops"]["base_model"]["config"]
    assert config["gguf_sha256"] == sha and len(config["gguf_parts"]) == count
    for i, spec in enumerate(config["gguf_parts"], 1):
        match = PART.match(spec)
        assert match and int(match["n"]) == int(match["m"]) == int(match["k"]) == i, spec


def test_variants_inherit_and_override_key_by_key():
    base, full, lora = (load_profile(n, "gpu") for n in ("gsm8k", "gsm8k-1.5b", "gsm8k-1.5b-lora"))
    assert full["ops"]["rewards"] == base["ops"]["rewards"] and full["resources"] == base["resources"]
    policy = lora["ops"]["policy_checkpoint"]["config"]
    assert policy["lora_rank"] == 32 and policy["lr"] == 2e-5 and policy["max_length"] == 768  # the parent's
    assert full["ops"]["policy_checkpoint"]["config"]["micro_batch_size"] == 16
    assert "lora_rank" not in full["ops"]["policy_checkpoint"]["config"]


def test_extends_cycles_and_bad_parents_are_named(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nops: {}\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ProfileError, match="makes a cycle"):
        load_profile(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("extends: [gsm8k, real]\n")
    with pytest.raises(ProfileError, match="extends must name one profile"):
        load_profile(str(tmp_path / "c.yaml"))
    (tmp_path / "d.yaml").write_text("extends: nope\n")
    with pytest.raises(ProfileError, match="unknown profile 'nope'"):
        load_profile(str(tmp_path / "d.yaml"))


def test_the_shipped_gsm8k_sample_reads_whole():
    landing = load_profile("gsm8k", "local")["resources"]["landing"]
    train = load_prompts(landing["prompts"], shape="gsm8k", quarantine=(quarantine := PromptQuarantine()))
    test = load_prompts(landing["eval_prompts"], shape="gsm8k")
    assert (len(train), len(test), quarantine.rows) == (64, 32, [])
