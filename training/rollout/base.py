"""The rollout-engine contract shared by the transformers (CPU/GPU) and vLLM (GPU) engines.

``generate(prompts, n=..., seed=..., messages=None)`` returns ``len(prompts) * n`` sample dicts, ordered by
``(prompt_index, sample_index)``, each with:

- ``prompt_index``, ``sample_index`` (int); ``prompt`` (the raw prompt), ``response`` (decoded text,
  special tokens skipped);
- ``prompt_ids``: token ids of the prompt rendered by ``batchrl.training.data.text.render_prompt``: a prompt's
  conversation (``messages``: per prompt its ``{role, content}`` list or JSON, or None) is rendered whole in
  its place. These are the ids the policy update trains on (it never re-encodes the prompt text);
- ``response_ids``: generated ids, including the eos token when one was generated;
- ``rollout_logprobs``: per response token, ``log softmax(logits)[token]`` under the *unwarped* policy
  (temperature 1, no top-p/top-k), i.e. what a plain forward pass of the same weights gives and
  what vLLM reports in its default ``raw_logprobs`` mode. At temperature 1 and top_p 1 this is
  exactly the sampling distribution; otherwise it is the policy's own log-prob, which is what
  PPO/GRPO importance ratios need;
  An engine built not to report them (``sampled_logprobs=False``: vLLM's default, as the trainer recomputes
  log-probs faster than vLLM reports them; evaluation's greedy engines) leaves the list empty for every sample;
- ``finish_reason``: ``"stop"`` (eos generated) or ``"length"`` (``max_new_tokens`` reached).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from batchrl.training.data.text import Messages


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], *, n: int, seed: int,
                 messages: list[Messages] | None = None) -> list[dict[str, Any]]:
        """Sample ``n`` responses per prompt (``messages``: per prompt its conversation, or None); the same
        seed gives the same samples."""
        ...


def make_sample(
    *,
    prompt_index: int,
    sample_index: int,
    prompt: str,
    response: str,
    prompt_ids: list[int],
    response_ids: list[int],
    rollout_logprobs: list[float],
    stopped: bool,
) -> dict[str, Any]:
    """One rollout record in the contract's shape (plain python types, JSON/Parquet friendly)."""
    if rollout_logprobs and len(response_ids) != len(rollout_logprobs):
        raise ValueError(f"{len(response_ids)} response ids but {len(rollout_logprobs)} logprobs")
    return {
        "prompt_index": int(prompt_index),
        "sample_index": int(sample_index),
        "prompt": prompt,
        "response": response,
        "prompt_ids": [int(t) for t in prompt_ids],
        "response_ids": [int(t) for t in response_ids],
        "rollout_logprobs": [float(x) for x in rollout_logprobs],
        "finish_reason": "stop" if stopped else "length",
    }
