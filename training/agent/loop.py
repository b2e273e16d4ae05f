"""The agent loop: multi-turn, tool-using rollouts over any rollout engine.

``AgentRollouts(engine, config).generate(prompts, n=..., seed=...)`` returns the engine contract's samples
(``training/rollout/base.py``) for trajectories: ``response_ids`` is everything after the prompt, the model's turns
and the observations between them, in order; ``loss_mask`` (one 0/1 per response token) marks the model's own
tokens, the only ones trained (``rollout_logprobs`` is 0 on observation tokens); ``response`` is the final model
turn's text (what rewards judge); ``turns`` keeps every turn with its role, tool call, observation, exit code,
status and timing (``schemas/trajectory.py``). Each turn the active rollouts are generated together (the engine's
own batching: the transformers and static engines' ``_generate_chunk`` in chunks of ``batch_size``, vLLM's
``generate_ids``), their tool calls run side by side in a thread pool, and the observations are appended.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from batchrl.training.agent.config import AgentConfig
from batchrl.training.agent.render import observation_ids, with_instructions
from batchrl.training.agent.tools import ToolBox, ToolCall, find_tool_call, observation_text
from batchrl.training.data.text import Messages, encode_prompts

# (contexts, max_new_tokens, seed) -> per context (new ids, their log-probs, stopped at an end-of-turn token)
TurnGenerator = Callable[[list[list[int]], int, int], list[tuple[list[int], list[float], bool]]]


# where a turn that calls a tool can stop early: vLLM stops on these strings (kept in the output). A python block's
# closing fence is a line of its own ("\n```\n"), its opening one is not ("```python"); a bare opening fence line
# would stop the turn too (then it has no call and ends the rollout, as it would in the other engines). The
# transformers and static engines have no stop strings: a turn runs to its end-of-turn token or cap and is cut after
# the call (AgentRollouts._model_turn), the tail's tokens generated for nothing.
STOP_STRINGS = {"python_block": ["\n```\n"], "tool_call_json": ["</tool_call>"]}


def turn_generator(engine: Any, stop: list[str] | None = None) -> TurnGenerator:
    """Generate one turn for many contexts with ``engine``: vLLM's ``generate_ids`` (stopping at ``stop``), else the
    transformers/static engines' ``_generate_chunk`` over length-sorted chunks of ``batch_size`` rows (their
    ``generate`` chunking)."""
    if hasattr(engine, "generate_ids"):
        return lambda contexts, max_new, seed: engine.generate_ids(contexts, max_new_tokens=max_new, seed=seed,
                                                                   stop=stop)

    def generate(contexts: list[list[int]], max_new: int, seed: int):
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        out: list[Any] = [None] * len(contexts)
        saved, engine.max_new_tokens = engine.max_new_tokens, max_new
        try:
            for chunk_index, start in enumerate(range(0, len(order), engine.batch_size)):
                chunk = order[start:start + engine.batch_size]
                rows = engine._generate_chunk([contexts[i] for i in chunk], seed * 1_000_003 + chunk_index)
                for i, row in zip(chunk, rows):
                    out[i] = row
        finally:
            engine.max_new_tokens = saved
        return out
    return generate


@dataclasses.dataclass
class Trajectory:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    state: dict
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[dict] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    final_text: str = ""
    no_logprobs: bool = False  # the engine reported none (vLLM's default): the sample carries none

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, trained: bool) -> None:
        self.ids += list(ids)
        self.mask += [int(trained)] * len(ids)
        if trained and ids and not logprobs:
            self.no_logprobs = True
        self.logprobs += list(logprobs) if logprobs else [0.0] * len(ids)


def _turn(role: str, content: str, tokens: int, **fields: Any) -> dict:
    """One row of ``turns`` (every key always present: one Parquet struct type)."""
    return {"role": role, "content": content, "tokens": tokens, "tool": fields.get("tool"),
            "tool_input": fields.get("tool_input"), "exit_code": fields.get("exit_code"),
            "status": fields.get("status"), "wall_s": float(fields.get("wall_s", 0.0)),
            "truncated": bool(fields.get("truncated", False))}


def cut_after(tokenizer: Any, ids: list[int], end_char: int) -> int:
    """The fewest leading ``ids`` whose text reaches character ``end_char`` of the decoded turn (the tool call's
    end): the model's turn is cut there, as if generation had stopped (binary search, ~log2(len) decodes)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= end_char:
            hi = mid
        else:
            lo = mid + 1
    return hi


class AgentRollouts:
    """Tool-using rollouts with ``engine`` (any ``RolloutEngine`` with a tokenizer and per-turn ``max_new_tokens``;
    ``tools=False`` runs the same prompts with no tool instructions and no calls: the one-turn baseline)."""

    def __init__(self, engine: Any, config: AgentConfig, *, tools: bool = True,
                 generator: TurnGenerator | None = None) -> None:
        self.engine, self.config, self.tools = engine, config, tools
        self.tokenizer = engine.tokenizer
        self.turn_tokens = int(engine.max_new_tokens)
        self.generator = generator or turn_generator(engine, STOP_STRINGS.get(config.tool_format))
        self.toolbox = ToolBox(config) if tools else None
        self.stats: dict[str, Any] = {}

    def _start(self, prompts: list[str], n: int, messages: list[Messages] | None) -> list[Trajectory]:
        instructions = self.config.instructions() if self.tools else ""
        convs = [with_instructions(p, None if messages is None else messages[i], instructions)
                 for i, p in enumerate(prompts)]
        encoded = encode_prompts(self.tokenizer, prompts, convs if instructions or messages else None)
        return [Trajectory(p, s, encoded[p], self.toolbox.new_state() if self.toolbox else {})
                for p in range(len(prompts)) for s in range(n)]

    def _model_turn(self, traj: Trajectory, ids: list[int], logprobs: list[float], stopped: bool,
                    turn: int) -> ToolCall | None:
        """Append the model's turn (cut after its tool call, and at the token budget); the call to run, or None
        when the rollout ended here."""
        budget = self.config.max_total_tokens - len(traj.ids)
        over_budget = len(ids) > budget
        ids, logprobs = ids[:budget], logprobs[:budget]  # logprobs may be [] (not reported)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        call = find_tool_call(text, self.config.tool_format) if self.tools else None
        if call is not None:
            keep = cut_after(self.tokenizer, ids, call.end)
            ids, logprobs = ids[:keep], logprobs[:keep]
        shown = self.tokenizer.decode(ids, skip_special_tokens=True)
        traj.add(ids, logprobs, trained=True)
        traj.final_text = shown
        if call is None:
            traj.turns.append(_turn("assistant", shown, len(ids)))
            traj.finish_reason = "stop" if stopped and not over_budget else "length"
            return None
        traj.turns.append(_turn("assistant", shown, len(ids), tool=call.name or None, tool_input=call.text))
        if turn + 1 >= self.config.max_turns:
            traj.finish_reason = "max_turns"  # a runaway loop: the last allowed turn still calls a tool
        elif len(traj.ids) >= self.config.max_total_tokens:
            traj.finish_reason = "length"
        return None if traj.finish_reason else call

    def _observe(self, traj: Trajectory, result: Any) -> None:
        text, truncated = observation_text(result, self.config.max_observation_chars)
        ids = observation_ids(self.tokenizer, text, self.config.observation_role)
        record = _turn(self.config.observation_role, text, len(ids), exit_code=result.exit_code,
                       status=result.status, wall_s=result.wall_s, truncated=truncated)
        traj.turns.append(record)
        if len(traj.ids) + len(ids) >= self.config.max_total_tokens:  # no room for the model to read it and answer
            record["tokens"] = 0
            traj.finish_reason = "length"
            return
        traj.add(ids, None, trained=False)

    def _run_tools(self, calls: list[tuple[Trajectory, ToolCall]]) -> list[Any]:
        workers = min(self.config.tool_workers, max(1, len(calls)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda item: self.toolbox.run(item[1], item[0].state), calls))

    def generate(self, prompts: list[str], *, n: int = 1, seed: int = 0,
                 messages: list[Messages] | None = None) -> list[dict[str, Any]]:
        """``n`` trajectories per prompt, in ``(prompt, sample)`` order; ``self.stats`` gets the timings."""
        trajs = self._start(prompts, n, messages)
        try:
            samples = self._roll(trajs, prompts, seed)
        finally:  # every trajectory's sandboxed interpreter ends with the batch, whatever happened
            for traj in trajs:
                self._end(traj)
        return samples

    def _end(self, traj: Trajectory) -> None:
        """The trajectory is over: its Python interpreter is killed and its scratch dir removed."""
        if self.toolbox is not None:
            self.toolbox.close_state(traj.state)

    def _roll(self, trajs: list[Trajectory], prompts: list[str], seed: int) -> list[dict[str, Any]]:
        generate_s = tool_s = tool_wall_sum = 0.0
        generated = 0  # tokens the engine produced, the tails after tool calls (cut off) included
        active = list(trajs)
        for turn in range(self.config.max_turns):
            if not active:
                break
            room = max(self.config.max_total_tokens - len(t.ids) for t in active)
            started = time.perf_counter()
            outs = self.generator([t.prompt_ids + t.ids for t in active], max(1, min(self.turn_tokens, room)),
                                  seed * 7919 + turn)
            generate_s += time.perf_counter() - started
            generated += sum(len(ids) for ids, _, _ in outs)
            calls = [(t, call) for t, (ids, lps, stopped) in zip(active, outs)
                     if (call := self._model_turn(t, list(ids), list(lps), stopped, turn))]
            started = time.perf_counter()
            results = self._run_tools(calls) if calls else []
            tool_s += time.perf_counter() - started
            for (traj, _), result in zip(calls, results):
                tool_wall_sum += result.wall_s
                self._observe(traj, result)
            for traj in active:
                if traj.finish_reason is not None:
                    self._end(traj)
            active = [t for t in trajs if t.finish_reason is None]
        self.stats = {"generate_s": generate_s, "tool_s": tool_s, "tool_call_wall_sum_s": tool_wall_sum,
                      "generated_tokens": generated, "sandbox": self.toolbox.sandbox if self.toolbox else {}}
        return [self._sample(t, prompts) for t in trajs]

    def _sample(self, traj: Trajectory, prompts: list[str]) -> dict[str, Any]:
        calls = [t for t in traj.turns if t["role"] == "assistant" and t["tool"] is not None]
        observations = [t for t in traj.turns if t["role"] != "assistant"]
        return {
            "prompt_index": traj.prompt_index, "sample_index": traj.sample_index, "prompt": prompts[traj.prompt_index],
            "response": traj.final_text, "prompt_ids": list(traj.prompt_ids), "response_ids": list(traj.ids),
            "rollout_logprobs": [] if traj.no_logprobs else [float(x) for x in traj.logprobs],
            "finish_reason": traj.finish_reason,
            "loss_mask": list(traj.mask), "turns": traj.turns,
            "num_turns": sum(t["role"] == "assistant" for t in traj.turns),
            "tool_calls": len(observations), "tool_errors": sum(t["status"] != "ok" for t in observations),
            "tool_wall_s": float(sum(t["wall_s"] for t in observations)),
            "unrun_tool_calls": len(calls) - len(observations),
        }
