"""Sampling as one call: build an engine, generate, write the samples; used in-process and by the job.

``sample_to_parquet`` is what the ``rollouts`` asset runs, either in the Dagster process (CPU) or in a
subprocess through Pipes (``batchrl.training.jobs.rollouts``), so that a GPU's memory — and vLLM's
engine with its own processes — is gone when the stage ends.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import pandas as pd


def sample_to_parquet(engine: dict[str, Any], prompts: list[str], *, n: int, seed: int, out_parquet: str,
                      messages: list | None = None, agent: dict | None = None,
                      built: tuple[Any, bool, float] | None = None) -> dict:
    """``engine`` = ``{"kind": ..., **make_rollout_engine kwargs}``; writes the contract's rows to
    ``out_parquet`` and returns timing and length statistics. ``messages``: per prompt its conversation
    (the prompts table's ``prompt_messages``) or None, rendered whole by the engine. ``agent``: an
    ``AgentConfig`` as a dict: multi-turn, tool-using trajectories (``training/agent``) instead of one turn.
    ``built``: ``(engine, reused, load seconds)`` made by the caller (sampling ahead: the trainer's weights in it)."""
    from batchrl.training.rollout import resident

    started = time.perf_counter()
    # in the job worker: the last job's engine, these weights copied in
    sampler, reused = built[:2] if built else resident.engine_for(engine)
    load_s = built[2] if built else time.perf_counter() - started
    started = time.perf_counter()
    agent_stats: dict = {}
    if agent is not None:
        from batchrl.training.agent import AgentConfig, AgentRollouts
        from batchrl.training.agent.stats import trajectory_stats

        loop = AgentRollouts(sampler, AgentConfig.model_validate(agent))
        rows = loop.generate(prompts, n=n, seed=seed, messages=messages)
        agent_stats = trajectory_stats(rows, loop.stats, time.perf_counter() - started)
    else:
        rows = sampler.generate(prompts, n=n, seed=seed, messages=messages)
    generate_s = time.perf_counter() - started
    started = time.perf_counter()
    samples = pd.DataFrame(rows)
    if agent is not None:  # checked before it is written; turns with their declared struct type
        from batchrl.schemas.trajectory import check_trajectories, write_trajectories

        check_trajectories(rows, out_parquet)
        write_trajectories(samples, out_parquet)
    else:
        samples.to_parquet(out_parquet, index=False)
    write_s = time.perf_counter() - started
    lengths = samples["response_ids"].map(len)
    shutdown = getattr(sampler, "shutdown", None)
    if not resident.keep(engine, sampler) and shutdown is not None:
        shutdown()
    return {"samples": len(samples), "engine_load_s": load_s, "engine_reused": reused, "generate_s": generate_s,
            "write_s": write_s,
            "generated_tokens_per_s": float(lengths.sum() / generate_s) if generate_s > 0 else 0.0,
            "mean_response_tokens": float(lengths.mean()) if len(samples) else 0.0,
            "stop_rate": float((samples["finish_reason"] == "stop").mean()) if len(samples) else 0.0, **agent_stats}


def write_stats(path: str, stats: dict) -> None:
    """The statistics of samples made ahead, written atomically after them: the mark that they are complete."""
    with open(path + ".tmp", "w") as f:
        json.dump({k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}, f)
    os.replace(path + ".tmp", path)
