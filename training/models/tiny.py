"""The embedded default model: a byte-level BPE tokenizer and a tiny Qwen2 causal LM, built offline.

``build_tiny_model`` makes an ordinary Hugging Face folder (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` ...), so every later stage loads it exactly like any
hub model (``loading.load_model_and_tokenizer``), and any HF causal-LM folder can take its place.

Determinism: the tokenizer trainer is deterministic for the same texts, the weights come from
``torch.manual_seed(seed)`` before ``from_config``; the same texts + seed give byte-identical
``tokenizer.json`` and ``model.safetensors``.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Qwen2-style chat template: every turn is ``<|im_start|>{role}\n{content}<|im_end|>\n``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE; digits are split one per token so arithmetic answers are learnable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Role names appear in every rendered prompt; include them so they merge into few tokens.
    corpus = list(texts) + ["user\n", "assistant\n", "system\n"] * 2
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=PAD_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    texts: Iterable[str],
    out_dir: str,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the tokenizer on ``texts``, build a seeded random ``Qwen2ForCausalLM``, save both to ``out_dir``.

    The model's vocabulary is exactly ``len(tokenizer)`` (BPE stops early when the texts have
    fewer merges than ``vocab_size`` allows). Returns metadata: parameter count, vocab, token ids
    and file paths.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    tokenizer = _train_tokenizer(texts, vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "architecture": type(model).__name__,
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "seed": seed,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "path": out_dir,
        "model_file": os.path.join(out_dir, "model.safetensors"),
        "tokenizer_file": os.path.join(out_dir, "tokenizer.json"),
    }
