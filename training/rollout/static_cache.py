"""A Llama-family decoder over a preallocated KV cache, with the decode step captured in a CUDA graph.

``generate`` in transformers re-plans every step (dynamic cache growth, mask building, Python per
layer), so on a GPU a small model's decode step is bound by kernel launches, not by the chip. Here the
HF model's own modules (embeddings, projections, norms, MLPs, rotary embedding, LM head — no weight
copy) run over fixed-shape buffers:

- cache ``k``/``v``: ``[layers, batch, kv_heads, slots, head_dim]``; rows are left-padded, so step
  ``t`` writes slot ``t`` in every row and row ``b`` sees slots ``pad[b] .. t``;
- positions are ``slot - pad[b]`` (what the HF forward uses for left-padded rows);
- ``decode_step`` reads only static tensors (``tokens``, ``positions``, ``slot``, ``pad``), so on CUDA it
  is captured once per (batch, slots) shape and replayed: one launch per generated token.

Supported: ``llama``, ``mistral`` (without sliding window), ``qwen2``, ``qwen3`` (per-head q/k norms).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


class UnsupportedModelError(ValueError):
    """The static-cache engine cannot run this architecture (use the 'transformers' engine)."""


def check_supported(config: Any) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the static-cache rollout engine supports {sorted(SUPPORTED_MODEL_TYPES)}, not {kind!r}: "
            "use rollout engine 'transformers' (plain generate) for this model")
    if getattr(config, "use_sliding_window", False) or (kind == "mistral" and getattr(config, "sliding_window", None)):
        raise UnsupportedModelError(f"{kind} with a sliding attention window is not supported by the static-cache "
                                    "engine: use rollout engine 'transformers'")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticKVDecoder:
    """The forward pass of ``model`` for ``batch`` rows over ``slots`` cache slots (see module doc)."""

    def __init__(self, model: Any, *, batch: int, slots: int, cuda_graphs: bool = True) -> None:
        check_supported(model.config)
        cfg, base = model.config, model.model
        self.model, self.base, self.batch, self.slots = model, base, batch, slots
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        shape = (len(base.layers), batch, cfg.num_key_value_heads, slots, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.slot_ids = torch.arange(slots, device=self.device)
        # static inputs of the decode step
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.use_graph = cuda_graphs and self.device.type == "cuda"
        self._graph: Any = None
        self._graph_logits: torch.Tensor | None = None

    def _attention(self, layer_index: int, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        rows, width, _ = x.shape
        q = attn.q_proj(x).view(rows, width, -1, self.head_dim)
        k = attn.k_proj(x).view(rows, width, -1, self.head_dim)
        v = attn.v_proj(x).view(rows, width, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        self.k[layer_index].index_copy_(2, slots, k)
        self.v[layer_index].index_copy_(2, slots, v)
        # Grouped-query attention without copying the cache per head: the query heads that share a kv
        # head (consecutive, as in HF's repeat_kv) are folded into the query axis of that kv head.
        kv_heads = self.k.shape[2]
        group = q.shape[1] // kv_heads
        q = q.reshape(rows, kv_heads, group * width, self.head_dim)
        mask = visible.expand(rows, 1, width, self.slots).repeat(1, 1, group, 1) if group > 1 else visible
        out = F.scaled_dot_product_attention(q, self.k[layer_index], self.v[layer_index], attn_mask=mask,
                                             scale=attn.scaling)
        # reshape: the memory-efficient kernel (cuDNN attention off) returns a non-contiguous layout
        out = out.reshape(rows, kv_heads * group, width, self.head_dim)
        return attn.o_proj(out.transpose(1, 2).reshape(rows, width, -1))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of the last column of ``tokens`` (``[batch, width]``) written at ``slots``."""
        # Row b sees its own slots from pad[b] up to the query's slot; a pad query also sees itself,
        # so no softmax row is empty (an all-masked row would turn into NaN and poison the cache).
        key = self.slot_ids.view(1, 1, 1, -1)
        query = slots.view(1, 1, -1, 1)
        visible = ((key >= self.pad.view(-1, 1, 1, 1)) & (key <= query)) | (key == query)
        h = self.base.embed_tokens(tokens)
        cos, sin = self.base.rotary_emb(h, positions)
        for index, layer in enumerate(self.base.layers):
            h = h + self._attention(index, layer.self_attn, layer.input_layernorm(h), cos, sin, slots, visible)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.base.norm(h[:, -1]))

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Fill slots ``0 .. width-1`` with the left-padded prompts; logits of their last position."""
        width = prompt_ids.shape[1]
        self.pad.copy_(pad)
        self.k.zero_()
        self.v.zero_()
        columns = torch.arange(width, device=self.device)
        positions = (columns.view(1, -1) - pad.view(-1, 1)).clamp(min=0)
        logits = self.forward(prompt_ids, positions, columns)
        self.slot.fill_(width)
        self.positions.copy_((width - pad).view(-1, 1))
        return logits

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Write ``tokens`` (``[batch]``) at the current slot, advance it; logits of the next token."""
        self.tokens.copy_(tokens.view(-1, 1))
        if not self.use_graph:
            logits = self.forward(self.tokens, self.positions, self.slot)
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            logits = self._graph_logits
        self.slot.add_(1)
        self.positions.add_(1)
        return logits

    def _capture(self) -> None:
        # Warm up on a side stream (lazy inits, autotuning) then capture; the warm-up's cache writes land
        # in the current slot, which the replay right after overwrites with the same values.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(self.tokens, self.positions, self.slot)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: a capture on a sampling-ahead thread (training/rollout/ahead.py) must not fail, nor fail the
        # export's copies, because the job's main thread uses CUDA meanwhile ("global" errors on other threads' calls)
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            self._graph_logits = self.forward(self.tokens, self.positions, self.slot)
