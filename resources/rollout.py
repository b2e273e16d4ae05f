"""Rollout engine resource, chosen per environment by config: which engine, on which device, and whether
sampling runs in the Dagster process (CPU) or in a subprocess through Pipes (GPU: its memory, and
vLLM's engine processes, are gone when the stage ends)."""
from __future__ import annotations

import os

import dagster as dg
import pandas as pd
from pydantic import Field, model_validator

from batchrl.common.prefetch_key import sampled_ahead


class RolloutEngineResource(dg.ConfigurableResource):
    kind: str = Field("transformers", description="transformers (plain generate) | static (static KV cache, "
                      "CUDA graphs; Llama-family models) | vllm")
    max_new_tokens: int = Field(12, description="tokens generated per response at most")
    temperature: float = Field(1.0, description="sampling temperature of the rollouts (the policy trainer's "
                               "temperature should match it)")
    top_p: float = Field(1.0, description="nucleus sampling: sample among the most likely tokens whose "
                         "probabilities add up to top_p; 1 = off")
    batch_size: int = Field(64, description="rows per chunk (transformers, static)")
    device: str = Field("cpu", description="device the transformers / static engines sample on: cpu | cuda | "
                        "cuda:N (vLLM places itself)")
    dtype: str = Field("float32", description="weights' dtype of the transformers / static engines: float32 | "
                       "bfloat16 | float16")
    gpu_memory_utilization: float = Field(0.5, description="vLLM's share of the GPU memory")
    sampled_logprobs: bool = Field(False, description="vLLM: report the sampled tokens' log-probs (for the "
                                   "truncated-IS correction); off, the trainer recomputes them, which is faster")
    in_subprocess: bool = Field(False, description="sample in a Pipes subprocess instead of the Dagster process")
    vllm_resident: bool = Field(False, description="vLLM: keep the engine in the rollouts job's worker between "
                                "iterations, asleep between jobs (weights in host memory, KV cache given back) and "
                                "each new checkpoint copied into it in place, instead of a fresh process and engine "
                                "start per rollouts step; needs kind vllm and in_subprocess")

    @model_validator(mode="after")
    def _resident_vllm_in_a_worker(self):
        if self.vllm_resident and (self.kind != "vllm" or not self.in_subprocess):
            raise ValueError(f"vllm_resident needs kind: vllm and in_subprocess: true (got kind {self.kind!r}, "
                             f"in_subprocess {self.in_subprocess}): the engine stays in the rollouts job's worker; "
                             "the other engines stay there by themselves")
        return self

    def engine_options(self, model_path: str, cache_dir: str) -> dict:
        """``make_rollout_engine`` kwargs (with ``kind``) for this engine."""
        options = dict(kind=self.kind, model_path=model_path, max_new_tokens=self.max_new_tokens,
                       temperature=self.temperature, top_p=self.top_p)
        if self.kind == "vllm":
            options.update(gpu_memory_utilization=self.gpu_memory_utilization, sampled_logprobs=self.sampled_logprobs,
                           compile_cache_dir=os.path.join(cache_dir, "vllm"))
            if self.vllm_resident:
                options["sleep_mode"] = True
        else:
            options.update(batch_size=self.batch_size, device=self.device, dtype=self.dtype)
        return options

    def sample(self, context: dg.AssetExecutionContext, launcher, *, model_path: str, prompts: list[str], n: int,
               seed: int, workdir: str, cache_dir: str, messages: list | None = None,
               agent: dict | None = None, prefetched: str | None = None) -> tuple[pd.DataFrame, dict]:
        """Samples (the engine contract's rows) and the sampling statistics; ``messages``: per prompt its
        conversation (JSON) or None, rendered whole by the engine; ``agent``: multi-turn tool use (``AgentConfig``
        as a dict; ``training/agent``), None for one turn. ``prefetched``: the folder a ``prefetch`` of this very
        request was handed (the samples are taken from it when it completed, in the prefetch worker), or that the
        last update's job sampled ahead (``training/rollout/ahead.py``)."""
        out = os.path.join(workdir, "samples.parquet")
        engine = self.engine_options(model_path, cache_dir)
        if self.in_subprocess:
            job_config = {"engine": engine, "prompts_parquet": _prompts_file(workdir, prompts, messages), "n": n,
                          "seed": seed, "out_parquet": out, "agent": agent, "prefetched_from": prefetched}
            # vLLM keeps an engine-core process and its memory pool: a fresh process gives them back when the
            # stage ends, the warm worker would not (unless vllm_resident: kept there asleep, for the next step)
            # an off-policy prefetch: in the rollouts worker that sampled it; sampled ahead by the update: where
            # the update ran (the job waits for it there)
            fresh = self.kind == "vllm" and not self.vllm_resident
            result = launcher.run_job(context, "rollouts", job_config, workdir, fresh_process=fresh,
                                      worker=PREFETCH_WORKER if prefetched and not sampled_ahead(prefetched) else None)
            stats = {k: getattr(v, "value", v) for k, v in (result.metadata or {}).items()}
        else:  # imported here: the engines' torch and transformers stay out of a Dagster process that hands off
            from batchrl.training.rollout.sampling_job import sample_to_parquet

            stats = {**sample_to_parquet(engine, prompts, n=n, seed=seed, out_parquet=out, messages=messages,
                                         agent=agent), "prefetched": False, "sampled_ahead": False}  # as the job
            from batchrl.resources.compute import release_accelerator_memory

            release_accelerator_memory(self.device)
        return pd.read_parquet(out), stats

    def samples_in_job_worker(self) -> bool:
        """Whether this engine samples in a kept job worker's process (not vLLM's processes), where an update's
        job can leave samples drawn ahead for the next rollouts job."""
        return self.in_subprocess and self.kind != "vllm"

    def can_prefetch(self, launcher) -> bool:
        """Whether ``prefetch`` can sample while the run goes on: job-worker sampling (not vLLM's processes)."""
        return self.samples_in_job_worker() and launcher.detached_worker()

    def prefetch(self, launcher, *, model_path: str, prompts: list[str], n: int, seed: int, folder: str,
                 cache_dir: str, messages: list | None = None, agent: dict | None = None) -> int:
        """Start sampling this request in the prefetch worker and return at once (its pid): the samples and then
        their statistics land in ``folder``, which a later ``sample(..., prefetched=folder)`` takes."""
        os.makedirs(folder, exist_ok=True)
        config = {"engine": self.engine_options(model_path, cache_dir), "n": n, "seed": seed, "agent": agent,
                  "prompts_parquet": _prompts_file(folder, prompts, messages),
                  "out_parquet": os.path.join(folder, "samples.parquet"),
                  "stats_json": os.path.join(folder, "stats.json")}
        return launcher.start_detached("rollouts", config, folder, PREFETCH_WORKER)


# the off-policy rollouts' worker of its own: it samples while the policy update trains in the GPU job slot's
PREFETCH_WORKER = "rollouts"


def _prompts_file(folder: str, prompts: list[str], messages: list | None) -> str:
    path = os.path.join(folder, "prompts.parquet")
    columns = {"prompt": prompts} if messages is None else {"prompt": prompts, "prompt_messages": messages}
    pd.DataFrame(columns).to_parquet(path, index=False)
    return path
