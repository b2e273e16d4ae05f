"""Qwen-shaped models with random weights and a byte-level BPE tokenizer of their full vocabulary
(151,936 ids), built offline: the benchmarks' stand-in for the real models (no hub downloads here).

    python3 bench/qwen_shape.py OUT_DIR [--shape qwen2-0.5b|qwen2.5-1.5b|qwen2.5-7b|tiny] [--layers N]
                                        [--dtype bfloat16] [--device cuda]

Shapes are the real configs (``SHAPES``); ``--device cuda`` initialises the weights on the GPU in ``dtype``
(a 7B never exists in fp32 on the host), then writes safetensors shards.

The tokenizer is synthetic but complete: the 256 byte symbols, every 2-byte merge, then 3-byte merges
until the vocabulary holds 151,936 ids (chat special tokens included), so any id the model samples
decodes, in HF and in vLLM alike. Texts tokenise into 2-3-byte pieces.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=32_768, rope_theta=1_000_000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
SHAPES = {
    "qwen2-0.5b": QWEN2_05B,
    "qwen2.5-1.5b": {**QWEN2_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-7b": {**QWEN2_05B, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
    # CPU smoke tests of the benches: the same code paths at toy size (small vocabulary, same tokenizer kind)
    "tiny": {**QWEN2_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "tie_word_embeddings": False},
}


def full_vocab_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from batchrl.training.models.tiny import CHAT_TEMPLATE, IM_END, IM_START, PAD_TOKEN, SPECIAL_TOKENS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    merges = []
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in (*pairs, *triples):
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=PAD_TOKEN, eos_token=IM_END,
                                        pad_token=PAD_TOKEN, additional_special_tokens=[IM_START],
                                        padding_side="left", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build(out_dir: str, *, layers: int | None = None, dtype: str = "bfloat16", seed: int = 0,
          shape: str = "qwen2-0.5b", device: str = "cpu") -> str:
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    dims = SHAPES[shape]
    tokenizer = full_vocab_tokenizer(dims["vocab_size"])
    assert len(tokenizer) == dims["vocab_size"], len(tokenizer)
    config = Qwen2Config(**{**dims, "num_hidden_layers": layers or dims["num_hidden_layers"]},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):  # weights are created (and initialised) there, in dtype
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(build(args.out_dir, layers=args.layers, dtype=args.dtype, shape=args.shape, device=args.device))
