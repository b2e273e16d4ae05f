"""The agent loop's settings (``rollouts`` config ``agent``; the same model drives the evaluation's tool runs).

A rollout is a sequence of turns: the model writes, and when its turn contains a tool call in the configured
``tool_format`` the loop runs the tool and appends its observation (cut to ``max_observation_chars``) as a
``observation_role`` turn rendered with the chat template, then lets the model go on; it ends when a turn has no
call (``stop`` / ``length``), at ``max_turns`` model turns (``max_turns``) or at ``max_total_tokens`` response
tokens, observations included (``length``). Formats (``training/agent/tools.py``):

- ``python_block``: the first fenced block ````` ```python ... ``` ````` of a turn is code for the ``python`` tool;
- ``tool_call_json``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes/Qwen style) calls
  ``python`` (``{"code": ...}``) or a user tool registered in ``tools`` by ``module:function``.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

TOOL_FORMATS = ("python_block", "tool_call_json")
BUILTIN_TOOLS = ("python",)

DEFAULT_SYSTEM_PROMPTS = {
    "python_block": "You can run Python. To run code, write it in a ```python block and stop; you will see its "
                    "output, then go on. State persists between blocks. Give the final answer as a number.",
    "tool_call_json": 'You can call tools. Write <tool_call>{"name": "python", "arguments": {"code": "..."}}'
                      "</tool_call> and stop; you will see the result, then go on. Give the final answer as a number.",
}


class AgentConfig(BaseModel):
    """Multi-turn, tool-using rollouts (``docs/AGENT.md``)."""

    model_config = ConfigDict(extra="forbid")

    tool_format: Literal[TOOL_FORMATS] = Field(  # type: ignore[valid-type]
        "python_block", description="how the model calls a tool: python_block (a fenced ```python block runs in the "
        "sandbox) | tool_call_json (<tool_call>{\"name\", \"arguments\"}</tool_call>)")
    max_turns: int = Field(4, ge=1, le=64, description="model turns per rollout at most; a tool call in the last "
                           "one is not run and the rollout ends with finish_reason max_turns")
    max_total_tokens: int = Field(512, ge=1, description="response tokens per rollout at most, the model's and "
                                  "the observations' together (finish_reason length past it)")
    max_observation_chars: int = Field(512, ge=16, description="an observation longer than this is cut (its "
                                       "head and tail kept, a marker between)")
    observation_role: Literal["tool", "user"] = Field("user", description="the chat role of an observation turn "
                                                      "(small instruct models know user better than tool)")
    system_prompt: Optional[str] = Field(None, description="instructions prepended as a system turn (unset: a "
                                         "short description of tool_format; empty string: none)")
    tool_timeout_s: float = Field(5.0, gt=0, le=120, description="wall clock of one tool call (the python "
                                  "tool's process tree is killed past it)")
    tool_memory_mb: int = Field(512, ge=64, description="address-space limit of one python tool call")
    tool_output_bytes: int = Field(16384, ge=256, description="stdout/stderr of one python call past which it is "
                                   "killed as a flood")
    tools: dict[str, str] = Field(default_factory=dict, description="user tools {name: module:function}, called "
                                  "as function(arguments: dict, state: dict) -> str (state: one dict per rollout); "
                                  "tool_call_json only")
    tool_workers: int = Field(8, ge=1, le=256, description="tool calls run side by side")
    python_state: Literal["persistent", "replay"] = Field(
        "persistent", description="persistent: one sandboxed interpreter per trajectory keeps the cells' state; "
        "replay: every call a fresh sandbox re-running the earlier cells (slower under load, same observations)")
    allow_weak_sandbox: bool = Field(False, description="run model code even where the sandbox is not a boundary "
                                     "(no bubblewrap and no user namespaces: the rlimits level); refused otherwise")

    @model_validator(mode="after")
    def _check(self):
        clash = sorted(set(self.tools) & set(BUILTIN_TOOLS))
        if clash:
            raise ValueError(f"agent.tools: {clash} is a built-in tool name; choose another")
        if self.tools and self.tool_format != "tool_call_json":
            raise ValueError("agent.tools: user tools are called by name, which needs tool_format: tool_call_json "
                             f"(python_block reaches only the python tool); got {self.tool_format}")
        for name, spec in self.tools.items():
            if ":" not in spec:
                raise ValueError(f"agent.tools.{name}: {spec!r} is not module:function")
        return self

    def instructions(self) -> str:
        """The system turn's text ('' = none)."""
        return DEFAULT_SYSTEM_PROMPTS[self.tool_format] if self.system_prompt is None else self.system_prompt
