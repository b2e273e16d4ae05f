"""Fast rollouts without vLLM: a static KV cache, CUDA-graph decode steps, sampling on the device.

Same contract as ``TransformersRolloutEngine`` (and the same chunking: rows ordered by prompt length,
``batch_size`` rows per chunk, each chunk seeded from ``(seed, chunk index)``). Per chunk: one prefill
over the left-padded prompts, then one decode step per token (``StaticKVDecoder``: replayed from a CUDA
graph on GPUs, eager elsewhere, the same code). Sampling is Gumbel-max over the temperature-scaled
(optionally top-p filtered) logits; the recorded log-prob is the unwarped ``log softmax(logits)`` of
the sampled token, as ``base`` defines. A short last chunk is filled up with copies of its last row so
that every chunk has one shape and the captured graphs are reused; the copies are dropped.
"""
from __future__ import annotations

from typing import Any

import torch

from batchrl.training.rollout.static_cache import StaticKVDecoder, check_supported
from batchrl.training.rollout.transformers_engine import TransformersRolloutEngine

SLOT_MULTIPLE = 64  # cache lengths are rounded up to this, so few graph shapes cover all prompt lengths
STOP_CHECK_EVERY = 16  # decode steps between checks (one host sync each) whether every row has stopped


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches ``top_p`` (nucleus), others -inf."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    outside = probs.cumsum(dim=-1) - probs > top_p  # mass before the token already reaches top_p
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered.masked_fill(outside, float("-inf")))


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` and their unwarped log-probs ``log softmax(logits)[token]``.

    ``temperature == 0`` is greedy; otherwise Gumbel-max: ``argmax(logits / T + g)``, ``g = -log(-log u)``,
    ``u ~ U(0, 1)``, which draws from ``softmax(logits / T)`` (restricted to the top-p nucleus).
    """
    logits = logits.float()
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / temperature
        if top_p < 1.0:
            scaled = top_p_filter(scaled, top_p)
        gumbel = -torch.log(-torch.log(torch.rand_like(scaled)))
        tokens = (scaled + gumbel).argmax(dim=-1)
    logprobs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)
    return tokens, logprobs


class StaticCacheRolloutEngine(TransformersRolloutEngine):
    """``RolloutEngine`` for Llama-family models (llama, mistral, qwen2, qwen3); ``cuda_graphs`` on GPUs."""

    def __init__(self, model_path: str | None = None, *, cuda_graphs: bool = True, **kwargs: Any) -> None:
        super().__init__(model_path, **kwargs)
        check_supported(self.model.config)
        self.cuda_graphs = cuda_graphs
        self._decoders: dict[int, StaticKVDecoder] = {}  # by cache length; one captured graph each

    def _rows_per_chunk(self, batch_size: int) -> int:
        return batch_size  # its decode loop keeps the sampled tokens' log-probs only, not the logits

    def _decoder(self, slots: int) -> StaticKVDecoder:
        if slots not in self._decoders:
            self._decoders[slots] = StaticKVDecoder(self.model, batch=self.batch_size, slots=slots,
                                                    cuda_graphs=self.cuda_graphs)
        return self._decoders[slots]

    @torch.no_grad()
    def _generate_chunk(self, prompt_ids: list[list[int]], seed: int) -> list[tuple[list[int], list[float], bool]]:
        real_rows = len(prompt_ids)
        prompt_ids = prompt_ids + [prompt_ids[-1]] * (self.batch_size - real_rows)
        width = max(len(ids) for ids in prompt_ids)
        pad_id = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad_id] * (width - len(row)) + row for row in prompt_ids], device=self.device)
        pad = torch.tensor([width - len(row) for row in prompt_ids], device=self.device)
        slots = -(-(width + self.max_new_tokens) // SLOT_MULTIPLE) * SLOT_MULTIPLE
        decoder = self._decoder(slots)
        stop_ids = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=self.device)
        tokens_out = torch.zeros(self.batch_size, self.max_new_tokens, dtype=torch.long, device=self.device)
        logprobs_out = torch.zeros(self.batch_size, self.max_new_tokens, dtype=torch.float32, device=self.device)
        stopped = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
        steps = 0
        with self._seeded_inference(seed):
            logits = decoder.prefill(ids, pad)
            while True:
                tokens, logprobs = sample_tokens(logits, self.temperature, self.top_p)
                tokens_out[:, steps], logprobs_out[:, steps] = tokens, logprobs
                stopped |= torch.isin(tokens, stop_ids)
                steps += 1
                if steps == self.max_new_tokens or (steps % STOP_CHECK_EVERY == 0 and bool(stopped.all())):
                    break
                logits = decoder.decode_step(tokens)
        logprobs = logprobs_out[:real_rows, :steps].tolist() if self.sampled_logprobs else \
            [[] for _ in range(real_rows)]
        return self._cut_at_stop(tokens_out[:real_rows, :steps].tolist(), logprobs)
