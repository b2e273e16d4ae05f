"""Rollouts with vLLM on GPU hosts (``pip install 'batchrl[gpu]'``); same contract as the transformers engine.

vllm is imported here only, when the engine is built. Prompts are rendered with ``render_prompt`` (a
multi-turn prompt: the chat template over all its messages) and passed as token ids, so prompt tokenisation is identical across engines. With ``sampled_logprobs``
``logprobs=0`` asks for the sampled token's log-prob only; ``logprobs_mode="raw_logprobs"`` (vLLM's
default, set explicitly) reports it from the raw logits (before temperature/top-p), the same convention
as ``base`` documents. Off by default: on an H200 asking for them cost 1.45-1.9x vLLM's throughput while
the trainer recomputes them in a fraction of that (bench/RESULTS.md); turn it on for the truncated-IS
correction of the engine mismatch (``rollout_is_threshold``) or ``old_logprobs="rollout"``.

A LoRA adapter folder as ``model_path``: vLLM loads its base and applies the adapter per request (its built-in
LoRA support, ``enable_lora``), so no merged weights are written anywhere.

Resident (``sleep_mode``, the rollout resource's ``vllm_resident``): the engine stays in the rollouts job's worker
between iterations (``training/rollout/resident.py``). Between jobs it sleeps (``LLM.sleep(level=1)``: weights to
host memory, the KV cache given back, so the trainer has the GPU); the next job wakes it and copies the new
checkpoint in place (``load_checkpoint``): vLLM's own ``load_weights`` in its worker (q/k/v and gate/up stacked
there, ``copy_`` into the same storage, so the captured CUDA graphs stay valid), or a new LoRA request.
"""
from __future__ import annotations

import os
from typing import Any

from batchrl.training.rollout.base import make_sample
from batchrl.training.data.text import Messages, encode_prompts


class VLLMUnavailableError(ImportError):
    """vLLM is not installed (it needs a CUDA host and the ``gpu`` extra)."""


def _import_vllm(compile_cache_dir: str | None = None):
    # Set before vLLM reads them. The compile cache (torch.compile artefacts, CUDA-graph plans) in a
    # persistent folder makes every later stage and iteration skip most of a cold start (bench/RESULTS.md).
    # We never filter with top-k, the one case FlashInfer's sampler is for: vLLM's own sampler instead.
    if compile_cache_dir:
        os.environ.setdefault("VLLM_CACHE_ROOT", compile_cache_dir)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailableError(
            "the 'vllm' rollout engine needs vLLM, which is not installed here: install it on a GPU "
            "host with `pip install 'batchrl[gpu]'`, or use the 'transformers' engine"
        ) from exc
    return vllm


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def _with_adapter(model_path: str, llm_kwargs: dict[str, Any]) -> tuple[str, Any]:
    """``(model vLLM loads, LoRA request per generate call)``: for an adapter folder its base and the adapter
    (``enable_lora`` and a ``max_lora_rank`` that holds its rank set in ``llm_kwargs``), else the folder, None."""
    from batchrl.training.models import lora

    if not lora.is_adapter_folder(model_path):
        return model_path, None
    from vllm.lora.request import LoRARequest

    rank = int(lora.read_adapter_config(model_path)["r"])
    llm_kwargs.setdefault("enable_lora", True)
    llm_kwargs.setdefault("max_lora_rank", next((r for r in VLLM_LORA_RANKS if r >= rank), rank))
    return lora.resolve_base(model_path), LoRARequest("batchrl-adapter", 1, os.path.abspath(model_path))


class VLLMRolloutEngine:
    """``RolloutEngine`` over ``vllm.LLM``; extra keyword arguments go to ``vllm.LLM``."""

    def __init__(
        self,
        model_path: str,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        compile_cache_dir: str | None = None,
        sampled_logprobs: bool = False,
        sleep_mode: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        if sleep_mode:
            # vLLM's cumem allocator: what sleep() gives back and wake_up() maps again; the engine core in this
            # process (as TRL's colocated engine): collective_rpc then calls load_weight_files directly, where an
            # engine-core process would need the function pickled (VLLM_ALLOW_INSECURE_SERIALIZATION)
            llm_kwargs.setdefault("enable_sleep_mode", True)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _import_vllm(compile_cache_dir)
        self._sampling_params = vllm.SamplingParams
        llm_kwargs.setdefault("logprobs_mode", "raw_logprobs")
        self._sleeps, self._asleep, self._adapter_id = bool(llm_kwargs.get("enable_sleep_mode")), False, 1
        model_path, self._lora_request = _with_adapter(model_path, llm_kwargs)
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.sampled_logprobs = sampled_logprobs

    def generate(self, prompts: list[str], *, n: int = 1, seed: int = 0,
                 messages: list[Messages] | None = None) -> list[dict[str, Any]]:
        params = self._sampling_params(
            n=n,
            seed=seed,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_new_tokens,
            logprobs=0 if self.sampled_logprobs else None,
        )
        self.resume()
        encoded = encode_prompts(self.tokenizer, list(prompts), messages)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False,
                                    lora_request=self._lora_request)
        samples = []
        for p, request in enumerate(outputs):
            for s, completion in enumerate(request.outputs):
                response_ids = list(completion.token_ids)
                logprobs = ([completion.logprobs[i][tok].logprob for i, tok in enumerate(response_ids)]
                            if self.sampled_logprobs else [])
                samples.append(
                    make_sample(
                        prompt_index=p,
                        sample_index=s,
                        prompt=prompts[p],
                        response=completion.text,
                        prompt_ids=encoded[p],
                        response_ids=response_ids,
                        rollout_logprobs=logprobs,
                        stopped=completion.finish_reason == "stop",
                    )
                )
        return samples

    def generate_ids(self, contexts: list[list[int]], *, max_new_tokens: int, seed: int,
                     stop: list[str] | None = None) -> list[tuple[list[int], list[float], bool]]:
        """One turn per token-id context (the agent loop, ``training/agent``): ``(new ids, their log-probs or [],
        stopped)`` per context, ``stopped`` when vLLM ended it (eos or a ``stop`` string, kept in the output). One
        ``SamplingParams`` per context, seeded ``seed + row``: rows with the same context (a prompt's group) must
        not draw the same sample, which one shared seed would make them do."""
        params = [self._sampling_params(n=1, seed=seed * 1_000_003 + row, temperature=self.temperature,
                                        top_p=self.top_p, max_tokens=max_new_tokens,
                                        logprobs=0 if self.sampled_logprobs else None, stop=stop or None,
                                        include_stop_str_in_output=True)
                  for row in range(len(contexts))]
        self.resume()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in contexts], params, use_tqdm=False,
                                    lora_request=self._lora_request)
        rows = []
        for request in outputs:
            completion = request.outputs[0]
            ids = list(completion.token_ids)
            logprobs = ([completion.logprobs[i][tok].logprob for i, tok in enumerate(ids)]
                        if self.sampled_logprobs else [])
            rows.append((ids, logprobs, completion.finish_reason == "stop"))
        return rows

    def load_checkpoint(self, model_path: str) -> bool:
        """Another checkpoint of this engine's model (``weights.same_model_files``) in place of its weights: a full
        checkpoint's safetensors copied in by ``load_weight_files`` in vLLM's worker, or an adapter as a new LoRA
        request (a new name and id: vLLM's prefix cache is keyed by the name; its LRU keeps ``max_loras``).
        False, the engine untouched, when ``model_path`` is not of its kind (full weights vs an adapter)."""
        from batchrl.training.models import lora
        from batchrl.training.models.weights import weight_files

        if lora.is_adapter_folder(model_path) != (self._lora_request is not None):
            return False
        self.resume()
        if self._lora_request is not None:
            from vllm.lora.request import LoRARequest

            self._adapter_id += 1
            self._lora_request = LoRARequest(f"batchrl-adapter-{self._adapter_id}", self._adapter_id,
                                             os.path.abspath(model_path))
        else:
            files = weight_files(model_path)
            if not files:
                return False
            self.llm.collective_rpc(load_weight_files, args=(files,))
        self.llm.reset_prefix_cache()  # cached KV blocks of the old weights would be reused: their keys are the tokens
        return True

    def suspend(self) -> None:
        """Between jobs, with ``sleep_mode``: weights to host memory, the KV cache given back (``LLM.sleep(1)``)."""
        if self._sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def resume(self) -> None:
        """The weights and KV cache back on the GPU after ``suspend`` (``LLM.wake_up``); else nothing."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process now rather than at interpreter exit."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def load_weight_files(worker: Any, files: list[str]) -> int:
    """Run in vLLM's worker (``LLM.collective_rpc`` passes its worker first): the safetensors ``files`` (HF tensor
    names) through the model's own ``load_weights``, which stacks q/k/v and gate/up and ``copy_``s into the existing
    parameters. Returns the tensors read."""
    from safetensors import safe_open

    read = 0

    def tensors():
        nonlocal read
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    read += 1
                    yield name, handle.get_tensor(name)

    worker.model_runner.get_model().load_weights(tensors())
    return read
