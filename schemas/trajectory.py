"""The contract of multi-turn, tool-using rollouts (``training/agent``): the columns a trajectory adds to the
rollouts Parquet beside the one-turn engine contract (``training/rollout/base.py``).

- ``response_ids``: every token after the prompt — the model's turns and the observations between them, in order;
- ``loss_mask``: per response token 1 (the model wrote it: trained) or 0 (a tool observation: never trained);
  ``rollout_logprobs`` (when reported) is 0 on the observations;
- ``turns``: one struct per turn, ``TURN_TYPE``: ``role`` (``assistant``, or the observation role ``user``/``tool``),
  ``content`` (the text), ``tokens`` (its response tokens; 0 for an observation that did not fit the budget),
  ``tool`` / ``tool_input`` (an assistant turn's call: the tool's name and its code or JSON arguments),
  ``exit_code`` / ``status`` (an observation's: ``training/agent/tools.STATUSES``), ``wall_s`` (the call's wall
  clock), ``truncated`` (the observation was cut to ``max_observation_chars``);
- ``finish_reason``: ``stop`` (a turn without a call ended with end-of-turn), ``length`` (the token budget),
  ``max_turns`` (the last allowed turn still called a tool); ``num_turns`` (model turns), ``tool_calls``,
  ``tool_errors``, ``unrun_tool_calls``, ``tool_wall_s``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pyarrow

if TYPE_CHECKING:
    import pandas as pd

TURN_TYPE = pyarrow.struct([
    ("role", pyarrow.string()), ("content", pyarrow.string()), ("tokens", pyarrow.int64()),
    ("tool", pyarrow.string()), ("tool_input", pyarrow.string()), ("exit_code", pyarrow.int64()),
    ("status", pyarrow.string()), ("wall_s", pyarrow.float64()), ("truncated", pyarrow.bool_())])
TRAJECTORY_COLUMNS = ("loss_mask", "turns", "num_turns", "tool_calls", "tool_errors", "unrun_tool_calls",
                      "tool_wall_s")
FINISH_REASONS = ("stop", "length", "max_turns")
STATUSES = ("ok", "error", "timeout", "output_limit", "invalid", "unknown_tool")


class TrajectoryContractError(ValueError):
    """A trajectory row breaks the contract; the message names the file, the row and the field."""


def check_trajectories(rows: Iterable[dict[str, Any]], where: str = "rollouts") -> int:
    """Check every row (``where`` names the file in the error); returns the number of rows."""
    count = 0
    for i, row in enumerate(rows):
        count += 1

        def fail(field: str, problem: str) -> None:
            raise TrajectoryContractError(f"{where}: row {i}, field {field}: {problem}")

        n, mask = len(row["response_ids"]), np.asarray(row["loss_mask"])
        if len(mask) != n:
            fail("loss_mask", f"{len(mask)} entries for {n} response tokens")
        if not np.isin(mask, (0, 1)).all():
            fail("loss_mask", "values other than 0 and 1")
        if n and mask[-1] != 1:
            fail("loss_mask", "the trajectory ends on an observation; it must end on a model token")
        if len(row["rollout_logprobs"]) not in (0, n):
            fail("rollout_logprobs", f"{len(row['rollout_logprobs'])} entries for {n} response tokens")
        if row["finish_reason"] not in FINISH_REASONS:
            fail("finish_reason", f"{row['finish_reason']!r} is not one of {FINISH_REASONS}")
        turns = list(row["turns"])
        own = sum(int(t["tokens"]) for t in turns if t["role"] == "assistant")
        if own != int(mask.sum()):
            fail("turns", f"the assistant turns hold {own} tokens, loss_mask counts {int(mask.sum())}")
        if sum(int(t["tokens"]) for t in turns) != n:
            fail("turns", f"the turns hold {sum(int(t['tokens']) for t in turns)} tokens for {n} response tokens")
        for t in turns:
            if t["role"] != "assistant" and t["status"] not in STATUSES:
                fail("turns.status", f"{t['status']!r} is not one of {STATUSES}")
        if row["tool_calls"] != sum(t["role"] != "assistant" for t in turns):
            fail("tool_calls", "does not count the observation turns")
    return count


def write_trajectories(samples: "pd.DataFrame", path: str) -> None:
    """Write ``samples`` to Parquet with ``turns`` of its declared type (a batch without a single tool call still
    types ``tool`` as a string, not null)."""
    import pyarrow.parquet as pq

    turns = pyarrow.array([list(t) for t in samples["turns"]], type=pyarrow.list_(TURN_TYPE))
    table = pyarrow.Table.from_pandas(samples.drop(columns=["turns"]), preserve_index=False)
    pq.write_table(table.append_column("turns", turns), path)
