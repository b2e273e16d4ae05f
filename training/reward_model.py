"""Bradley-Terry reward model: a causal LM folder with a scalar head, trained on preference pairs.

The RM is ``AutoModelForSequenceClassification(num_labels=1)`` initialised from the base model folder
(``Qwen2ForSequenceClassification`` for the embedded default); its score for ``(prompt, response)``
is the head's output at the last non-pad token of ``render(prompt) + response + eos``
(``encode_prompt_completion``). Training (``batchrl.training.trainer.reward``, on the DeepSpeed engine
like the other trainers) minimises ``-log sigmoid(r_chosen - r_rejected)`` (``bradley_terry_loss``).
The result is an ordinary HF folder (safetensors + tokenizer).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from batchrl.training.phases import phase
from batchrl.training.text import encode_prompt_completions
from batchrl.training.tiny_model import load_tokenizer, placed_on, resolve_dtype


def right_padded_batch(sequences: list[list[int]], pad_id: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` with right padding (positions of real tokens stay 0..L-1)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    from batchrl.training.transfer import to_device_async

    return to_device_async(ids, device), to_device_async(mask, device)


def load_reward_model(path: str, *, dtype: torch.dtype | str = torch.float32, device: str = "cpu", num_labels: int = 1):
    """Any HF folder as a scalar-head sequence classifier, with the pad token id set in its config."""
    from transformers import AutoModelForSequenceClassification

    with phase("load_model"):
        tokenizer = load_tokenizer(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels,
                                                                   dtype=resolve_dtype(dtype), **placed_on(device))
        model.config.pad_token_id = tokenizer.pad_token_id
        return model.to(device), tokenizer


def reward_scores(model: Any, tokenizer: Any, prompts: list[str], responses: list[str], *, max_length: int) -> torch.Tensor:
    """Scalar score per (prompt, response), shape ``[B]``, differentiable (one forward pass)."""
    sequences = [ids for ids, _ in encode_prompt_completions(tokenizer, list(prompts), list(responses), max_length)]
    device = next(model.parameters()).device
    ids, mask = right_padded_batch(sequences, tokenizer.pad_token_id, device)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


@torch.no_grad()
def score_texts(
    model: Any, tokenizer: Any, prompts: list[str], responses: list[str], *, batch_size: int = 32, max_length: int = 256,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Scores of many (prompt, response) pairs as float32 numpy, in input order. Tokenised in one call,
    scored in batches of similar length (``batch_size`` rows, or ``max_tokens`` padded tokens when set),
    read back once at the end: no host work or sync between the batches' forward passes."""
    from batchrl.training.trainer.batching import length_sorted_batches

    if not len(prompts):
        return np.zeros(0, dtype=np.float32)
    was_training = model.training
    model.eval()
    with phase("tokenise"):
        sequences = [ids for ids, _ in encode_prompt_completions(tokenizer, list(prompts), list(responses), max_length)]
    device = next(model.parameters()).device
    batches = length_sorted_batches([len(s) for s in sequences], None if max_tokens else batch_size, max_tokens)
    scores = []
    with phase("rm_score"):
        for idx in batches:
            ids, mask = right_padded_batch([sequences[i] for i in idx], tokenizer.pad_token_id, device)
            scores.append(model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
        out = np.empty(len(sequences), dtype=np.float32)
        out[np.concatenate(batches)] = torch.cat(scores).cpu().numpy()
    model.train(was_training)
    return out


def pair_accuracy(model, tokenizer, pairs: pd.DataFrame, *, batch_size: int, max_length: int,
                  max_tokens: int | None = None) -> tuple[float, float]:
    """(accuracy = P[r_chosen > r_rejected], mean Bradley-Terry loss) over all pairs."""
    prompts = pairs["prompt"].tolist()
    both = score_texts(model, tokenizer, prompts * 2, pairs["chosen"].tolist() + pairs["rejected"].tolist(),
                       batch_size=batch_size, max_length=max_length, max_tokens=max_tokens)
    chosen, rejected = both[:len(prompts)], both[len(prompts):]
    diff = torch.from_numpy(chosen - rejected).double()
    return float((diff > 0).double().mean()), float(-torch.nn.functional.logsigmoid(diff).mean())
