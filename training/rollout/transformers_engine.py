"""Rollouts with Hugging Face ``generate`` (CPU or one GPU): the default engine, and the reference
the vLLM engine is held to.

Prompts are rendered with ``render_prompt`` (a multi-turn prompt: the chat template over all its
messages) and left-padded; ``prompts * n`` rows are generated in
chunks of ``batch_size``. Each chunk reseeds torch from ``(seed, chunk index)`` inside a forked RNG,
so a run is deterministic for a fixed seed and batch size and leaves the caller's RNG untouched.
Rows are chunked in order of prompt length (less padding); samples come back in ``(prompt, sample)`` order.
``rollout_logprobs`` come from the raw logits (``output_logits``), see ``base`` for the convention. ``generate``
keeps every step's logits of a chunk until it returns (fp32: rows x new tokens x vocabulary x 4 bytes, 10 GB for 32
rows of 512 tokens at Qwen2.5's 152k vocabulary), so chunks are cut to ``LOGITS_BUDGET_BYTES``; an engine built
with ``sampled_logprobs=False`` (evaluation's greedy answers) asks for no logits and keeps its batch size.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from batchrl.training.rollout.base import make_sample
from batchrl.training.data.text import Messages, context_texts, encode_prompts
from batchrl.training.models.loading import load_model_and_tokenizer

LOGITS_BUDGET_BYTES = 2 << 30


def _stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TransformersRolloutEngine:
    """``RolloutEngine`` over ``transformers`` generate; ``temperature=0`` means greedy decoding."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 32,
        device: str = "cpu",
        dtype: str = "float32",
        model: Any = None,
        tokenizer: Any = None,
        sampled_logprobs: bool = True,
    ) -> None:
        """Load ``model_path``, or use an already loaded ``model`` + ``tokenizer`` (e.g. the trainer's).
        ``sampled_logprobs=False``: samples carry no ``rollout_logprobs`` (nothing reads them), no logits are kept."""
        if model is None:
            model, tokenizer = load_model_and_tokenizer(model_path, dtype=dtype, device=device)
        elif tokenizer is None:
            raise ValueError("pass tokenizer together with model")
        self.model, self.tokenizer = model, tokenizer
        self.tokenizer.padding_side = "left"
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.sampled_logprobs = sampled_logprobs
        self.batch_size = self._rows_per_chunk(batch_size)
        self.device = next(model.parameters()).device
        self.stop_ids = _stop_token_ids(model, tokenizer)
        self._last_encoded: tuple[tuple | None, list[list[int]]] = (None, [])

    def _rows_per_chunk(self, batch_size: int) -> int:
        """``batch_size``, cut so that a chunk's kept logits (``generate``'s, fp32) fit ``LOGITS_BUDGET_BYTES``."""
        if not self.sampled_logprobs:
            return batch_size
        row_bytes = self.max_new_tokens * self.model.get_output_embeddings().weight.shape[0] * 4
        return min(batch_size, max(1, LOGITS_BUDGET_BYTES // row_bytes))

    def _generation_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(self.stop_ids),
            return_dict_in_generate=True,
            output_logits=self.sampled_logprobs,
        )
        if self.temperature > 0:
            # top_k=0 switches off the library default of 50: we sample from the full distribution.
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False)
        return kwargs

    @contextlib.contextmanager
    def _seeded_inference(self, seed: int) -> Iterator[None]:
        """Eval mode and a forked RNG seeded with ``seed`` (the caller's RNG stream stays untouched)."""
        was_training = self.model.training
        self.model.eval()  # an in-memory policy handed over by a trainer may be in train mode
        try:
            with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                torch.manual_seed(seed)
                yield
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def _generate_chunk(self, prompt_ids: list[list[int]], seed: int) -> list[tuple[list[int], list[float], bool]]:
        """Generate one response per row; returns ``(response_ids, logprobs, stopped)`` per row."""
        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=self.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=self.device
        )
        with self._seeded_inference(seed):
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **self._generation_kwargs())
        new_tokens = out.sequences[:, width:]
        if not self.sampled_logprobs:
            return self._cut_at_stop(new_tokens.tolist(), [[] for _ in prompt_ids])
        # logits: one [B, V] tensor per generated step; a step at a time, not a second [B, steps, V] copy
        token_logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None])[:, 0]
                                      for t, step in enumerate(out.logits)], dim=1)
        return self._cut_at_stop(new_tokens.tolist(), token_logprobs.tolist())

    def _cut_at_stop(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[tuple[list[int], list[float], bool]]:
        """Per row: ``(response_ids, logprobs, stopped)`` up to and including the first stop token."""
        rows = []
        for row_tokens, row_logprobs in zip(tokens, logprobs):
            stop_at = next((i for i, t in enumerate(row_tokens) if t in self.stop_ids), None)
            end = len(row_tokens) if stop_at is None else stop_at + 1
            rows.append((row_tokens[:end], row_logprobs[:end], stop_at is not None))
        return rows

    def _encode_prompts(self, prompts: list[str], messages: list[Messages] | None = None) -> list[list[int]]:
        """The chat-rendered prompts' ids (``messages``: per prompt its conversation, or None); the last call's
        are kept (evaluation asks the same prompts of each checkpoint it copies into this engine: rendering
        them is host time with the GPU idle)."""
        key = tuple(zip(prompts, context_texts(prompts, messages)))
        if self._last_encoded[0] != key:
            self._last_encoded = (key, encode_prompts(self.tokenizer, list(prompts), messages))
        return self._last_encoded[1]

    def generate(self, prompts: list[str], *, n: int = 1, seed: int = 0,
                 messages: list[Messages] | None = None) -> list[dict[str, Any]]:
        encoded = self._encode_prompts(prompts, messages)
        # Rows are chunked in order of prompt length, so a chunk's prompts need little padding.
        jobs = sorted(((p, s) for p in range(len(prompts)) for s in range(n)), key=lambda job: len(encoded[job[0]]))
        results: dict[tuple[int, int], tuple[list[int], list[float], bool]] = {}
        for chunk_index, start in enumerate(range(0, len(jobs), self.batch_size)):
            chunk = jobs[start : start + self.batch_size]
            chunk_seed = seed * 1_000_003 + chunk_index
            results.update(zip(chunk, self._generate_chunk([encoded[p] for p, _ in chunk], chunk_seed)))
        order = [(p, s) for p in range(len(prompts)) for s in range(n)]
        # one batch call: a fast tokenizer decodes the rows in parallel, outside the GIL
        texts = self.tokenizer.batch_decode([results[job][0] for job in order], skip_special_tokens=True)
        samples: list[dict[str, Any]] = []
        for (p, s), response in zip(order, texts):
            response_ids, logprobs, stopped = results[(p, s)]
            samples.append(make_sample(prompt_index=p, sample_index=s, prompt=prompts[p], response=response,
                                       prompt_ids=encoded[p], response_ids=response_ids,
                                       rollout_logprobs=logprobs, stopped=stopped))
        return samples
