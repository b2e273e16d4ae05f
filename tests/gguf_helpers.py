"""A tiny llama GGUF written with llama.cpp's own conventions (tensor names, q/k row permutation, byte-level BPE
tokenizer metadata), so it exercises the same transformers loader a real file does (test_gguf_source,
test_gguf_parts)."""
from __future__ import annotations

import json

import numpy as np

N_LAYERS, HIDDEN, N_HEADS, N_KV, INTER = 2, 32, 4, 2, 64
HEAD_DIM = HIDDEN // N_HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = ["what is two plus two? four.", "hello world, the answer is 42.", "abc def ghi jkl"] * 20


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (rotary halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    return tok


def write_tiny_gguf(path: str) -> tuple[dict[str, np.ndarray], object]:
    """Write the GGUF; return the HF-layout weights it encodes and the source tokenizer."""
    import gguf

    tok = train_tokenizer()
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
        g = {"attn_q": llama_cpp_permute(layer["self_attn.q_proj"], N_HEADS),
             "attn_k": llama_cpp_permute(layer["self_attn.k_proj"], N_KV),
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
