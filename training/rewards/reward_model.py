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

from batchrl.training.timing.phases import phase
from batchrl.training.data.scoring import score_in_batches
from batchrl.training.data.text import encode_prompt_completions, prompt_messages
from batchrl.training.models.loading import load_pretrained, load_tokenizer


def right_padded_batch(sequences: list[list[int]], pad_id: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` with right padding (positions of real tokens stay 0..L-1)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    from batchrl.training.data.transfer import to_device_async

    return to_device_async(ids, device), to_device_async(mask, device)


def load_reward_model(path: str, *, dtype: torch.dtype | str = torch.float32, device: str = "cpu", num_labels: int = 1,
                      tokenizer: Any = None):
    """Any HF folder as a scalar-head sequence classifier, with the pad token id set in its config
    (``tokenizer``: the folder's, already loaded). In the job worker, a trained reward model loaded before
    (``rewards``, then ``evaluation``) comes from its weight cache (``load_pretrained``)."""
    from transformers import AutoModelForSequenceClassification

    with phase("load_model"):
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        model = load_pretrained(path, AutoModelForSequenceClassification, dtype=dtype, device=device,
                                kind=f"sequence_classification/{num_labels}", num_labels=num_labels)
        model.config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer


def encode_scored(tokenizer: Any, prompts: list[str], responses: list[str], max_length: int,
                  messages: list | None = None) -> list[list[int]]:
    """Token ids the reward model scores for each (prompt, response): ``render(prompt) + response + eos``
    (``messages``: multi-turn contexts rendered in the prompts' place)."""
    return [ids for ids, _ in encode_prompt_completions(tokenizer, list(prompts), list(responses), max_length,
                                                        messages=messages)]


def sequence_scores(model: Any, sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    """Scalar score per token sequence (``encode_scored``), shape ``[B]``, differentiable (one forward pass)."""
    ids, mask = right_padded_batch(sequences, pad_id, next(model.parameters()).device)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def reward_scores(model: Any, tokenizer: Any, prompts: list[str], responses: list[str], *, max_length: int) -> torch.Tensor:
    """Scalar score per (prompt, response), shape ``[B]``, differentiable (one forward pass)."""
    return sequence_scores(model, encode_scored(tokenizer, prompts, responses, max_length), tokenizer.pad_token_id)


@torch.no_grad()
def score_texts(
    model: Any, tokenizer: Any, prompts: list[str], responses: list[str], *, batch_size: int = 32, max_length: int = 256,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Scores of many (prompt, response) pairs as float32 numpy, in input order. Tokenised in one call,
    scored in batches of similar length (``batch_size`` rows, or ``max_tokens`` padded tokens when set),
    read back once at the end: no host work or sync between the batches' forward passes."""
    with phase("tokenise"):
        sequences = encode_scored(tokenizer, prompts, responses, max_length)
    return score_sequences(model, sequences, tokenizer.pad_token_id, batch_size=batch_size, max_tokens=max_tokens)


def score_sequences(model: Any, sequences: list[list[int]], pad_id: int, *, batch_size: int = 32,
                    max_tokens: int | None = None) -> np.ndarray:
    """``score_texts`` of sequences already tokenised (``encode_scored``)."""
    if not len(sequences):
        return np.zeros(0, dtype=np.float32)
    with phase("rm_score"):
        return score_in_batches(model, [len(s) for s in sequences],
                                lambda idx: sequence_scores(model, [sequences[i] for i in idx], pad_id),
                                batch_size=None if max_tokens else batch_size, max_tokens=max_tokens)


def encode_pairs_scored(tokenizer: Any, pairs: pd.DataFrame, max_length: int) -> list[list[int]]:
    """The scored sequences of every pair: the chosen ones (pair order), then the rejected ones."""
    prompts = pairs["prompt"].tolist()
    messages = prompt_messages(pairs.to_dict("records"))
    return encode_scored(tokenizer, prompts * 2, pairs["chosen"].tolist() + pairs["rejected"].tolist(), max_length,
                         messages=None if messages is None else messages * 2)


def pair_accuracy(model, pad_id: int, sequences: list[list[int]], *, batch_size: int,
                  max_tokens: int | None = None) -> tuple[float, float]:
    """(accuracy = P[r_chosen > r_rejected], mean Bradley-Terry loss) over all pairs (``encode_pairs_scored``)."""
    both = score_sequences(model, sequences, pad_id, batch_size=batch_size, max_tokens=max_tokens)
    chosen, rejected = both[:len(both) // 2], both[len(both) // 2:]
    diff = torch.from_numpy(chosen - rejected).double()
    return float((diff > 0).double().mean()), float(-torch.nn.functional.logsigmoid(diff).mean())
