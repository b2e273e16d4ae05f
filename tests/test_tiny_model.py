import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrl.training.data.text import render_prompt
from batchrl.training.models.loading import load_model_and_tokenizer
from batchrl.training.models.tiny import build_tiny_model

ARITH = Path(__file__).resolve().parents[1] / "sample_data" / "arith"


def arith_texts():
    rows = [json.loads(line) for line in (ARITH / "train.jsonl").read_text().splitlines()]
    return [f"{r['prompt']} {r['answer']}" for r in rows]


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(arith_texts(), str(out), seed=0)


def test_build_writes_hf_folder_loadable_by_auto_classes(built):
    path = built["path"]
    assert (Path(path) / "model.safetensors").exists() and (Path(path) / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert built["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert model.config.vocab_size == len(tokenizer) == built["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_chat_template_and_digit_tokenisation(built):
    tokenizer = AutoTokenizer.from_pretrained(built["path"])
    rendered = render_prompt(tokenizer, "What is 13 + 4?")
    assert rendered == "<|im_start|>user\nWhat is 13 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == rendered
    pieces = tokenizer.tokenize("123 + 4567")
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces == ["1", "2", "3", "4", "5", "6", "7"]  # one token per digit
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id


def test_generate_round_trip(built):
    model, tokenizer = load_model_and_tokenizer(built["path"])
    batch = tokenizer([render_prompt(tokenizer, "What is 2 + 3?")], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, batch["input_ids"].shape[1] + 5) or tokenizer.eos_token_id in out[0].tolist()
    prompt = tokenizer.decode(batch["input_ids"][0])
    assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == batch["input_ids"][0].tolist()  # ids, text, ids
    assert tokenizer.decode(out[0]).startswith(prompt)  # the generated sequence continues the prompt


def test_rebuild_is_byte_identical_and_seed_matters(built, tmp_path):
    again = build_tiny_model(arith_texts(), str(tmp_path / "again"), seed=0)
    assert sha(again["model_file"]) == sha(built["model_file"])
    assert sha(again["tokenizer_file"]) == sha(built["tokenizer_file"])
    other = build_tiny_model(arith_texts(), str(tmp_path / "other"), seed=1)
    assert sha(other["model_file"]) != sha(built["model_file"])
    assert sha(other["tokenizer_file"]) == sha(built["tokenizer_file"])


def test_load_model_and_tokenizer_dtype(built):
    model, tokenizer = load_model_and_tokenizer(built["path"], dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert tokenizer.padding_side == "left"


def test_weights_are_loaded_onto_the_device_they_run_on(built, monkeypatch):
    """On an accelerator the loaders hand the device to from_pretrained (weights read and cast there, no
    host copy); on the CPU the default loading. Checked through the keywords from_pretrained receives."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from batchrl.training.rewards.reward_model import load_reward_model
    from batchrl.training.models.loading import placed_on

    assert placed_on("cpu") == {} and placed_on(torch.device("cpu")) == {}
    assert placed_on("cuda") == {"device_map": "cuda"} and placed_on("cuda:1") == {"device_map": "cuda:1"}
    seen = []
    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification):
        original = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained", classmethod(
            lambda c, *a, _original=original, **k: seen.append(k.get("device_map")) or _original(c, *a, **k)))
    model, _ = load_model_and_tokenizer(built["path"], device="cpu")
    reward_model, _ = load_reward_model(built["path"], device="cpu")
    assert seen == [None, None] and not hasattr(model, "hf_device_map")
    assert next(reward_model.parameters()).device.type == "cpu"


def test_tokenizer_loaded_once_per_content_each_caller_its_own_settings(built, tmp_path, monkeypatch):
    import shutil

    import transformers

    from batchrl.training.models import loading

    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: calls.append(a) or real(*a, **k)))
    monkeypatch.setattr(loading, "_TOKENIZERS", type(loading._TOKENIZERS)())
    first = loading.load_tokenizer(built["path"])
    export = tmp_path / "export"  # an exported checkpoint: the same tokenizer files, other weights
    shutil.copytree(built["path"], export, ignore=shutil.ignore_patterns("*.safetensors"))
    (export / "lineage.json").write_text("{}")  # its own records beside it
    with open(export / "config.json") as f:  # a reward model: another head and architecture, same tokenizer
        model_config = json.load(f)
    with open(export / "config.json", "w") as f:
        json.dump({**model_config, "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}, f)
    second = loading.load_tokenizer(str(export))
    assert len(calls) == 1  # parsed once
    second.padding_side, second.pad_token = "right", "<|im_end|>"
    assert (first.padding_side, first.pad_token) == ("left", "<|endoftext|>")  # the callers' settings are apart
    assert first("12+3").input_ids == second("12+3").input_ids
    assert first(["1", "12+34"], padding=True).input_ids[0][0] == first.pad_token_id  # still left-padded
    with open(export / "tokenizer_config.json") as f:
        config = json.load(f)
    config["model_max_length"] = 77  # edited tokenizer files: loaded afresh
    with open(export / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    assert loading.load_tokenizer(str(export)).model_max_length == 77 and len(calls) == 2
