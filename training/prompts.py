"""Prompt sets for rollouts: JSONL or Parquet rows with ``prompt`` (+ optional ``answer``, ``category``,
``id``, ``data_source``, ``tests``).

``mapping`` renames fields on the way in, with dotted paths into nested records, so verl-format
Parquet (``prompt`` as a chat, ``data_source``, ``reward_model: {style, ground_truth}``) loads with
``{"reward_model.ground_truth": "answer"}`` and GSM8K files with ``{"question": "prompt"}``. A chat
prompt must be one user message (what verl's GSM8K/MATH preprocessing writes); it becomes its text,
rendered later with the model's chat template like every prompt (``training.text.render_prompt``).
``data_sources`` names the ``data_source`` values the set may carry: a row with another is refused here,
when the prompts are validated (verl's reward manager fails on it only when rewards run).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import pandas as pd

from batchrl import fsutil

PROMPT_COLUMNS = ["prompt_id", "prompt", "answer", "category"]
# Optional per-prompt fields carried to the rewards: where the prompt comes from (reward routing,
# as verl's data_source) and the code-execution reward's tests (kept as JSON text).
PROMPT_EXTRAS = ["data_source", "tests"]


class PromptFileError(ValueError):
    """A prompt file that breaks the contract; the message names file, line and field."""


_MISSING = object()


def _dotted(row: dict, path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def apply_mapping(row: dict, mapping: dict[str, str] | None) -> dict:
    """``row`` plus ``{target: row[dotted source]}`` for each mapped field present in the row."""
    out = dict(row)
    for source, target in (mapping or {}).items():
        value = _dotted(row, source)
        if value is not _MISSING:
            out[target] = value
    return out


def _chat_text(where: str, prompt: Any) -> Any:
    if not isinstance(prompt, (list, tuple)):
        return prompt
    messages = list(prompt)
    if len(messages) == 1 and isinstance(messages[0], dict) and messages[0].get("role") == "user":
        return messages[0].get("content")
    roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages]
    raise PromptFileError(f"{where}: field 'prompt' is a chat with roles {roles}; only a single user message "
                          "is supported")


def _check_row(where: str, row: Any, mapping: dict[str, str] | None = None,
               data_sources: frozenset[str] | None = None) -> dict:
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    row = apply_mapping(row, mapping)
    prompt = _chat_text(where, row.get("prompt"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptFileError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise PromptFileError(f"{where}: field 'answer' must be a string or number, got {answer!r}")
    prompt_id = row.get("id") or hashlib.sha256(prompt.encode()).hexdigest()[:16]
    data_source, tests = row.get("data_source"), row.get("tests")
    if data_source is not None and not isinstance(data_source, str):
        raise PromptFileError(f"{where}: field 'data_source' must be a string, got {data_source!r}")
    if data_sources is not None and data_source is not None and data_source not in data_sources:
        raise PromptFileError(f"{where}: unknown data_source {data_source!r}: the rewards know "
                              f"{sorted(data_sources)} (add it to the prompts config data_sources and route it)")
    if tests is not None and not isinstance(tests, (list, dict)):
        raise PromptFileError(f"{where}: field 'tests' must be a list of test statements or "
                              f"{{'inputs': [...], 'outputs': [...]}}, got {type(tests).__name__}")
    return {"prompt_id": str(prompt_id), "prompt": prompt.strip(),
            "answer": None if answer is None else str(answer), "category": row.get("category"),
            "data_source": data_source, "tests": None if tests is None else json.dumps(tests)}


def load_prompts(uri: str, storage_options: dict | None = None, mapping: dict[str, str] | None = None,
                 data_sources=None) -> pd.DataFrame:
    """Read a JSONL or Parquet prompt file (local or s3://), failing on the first bad line/row with
    file:line (or row):field; ``mapping`` and ``data_sources`` as in the module docstring."""
    data_sources = None if data_sources is None else frozenset(data_sources)
    fs, path = fsutil.filesystem_for(uri, storage_options)
    rows = []
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            records = pq.read_table(f).to_pylist()
        rows = [_check_row(f"{uri}: row {i}", record, mapping, data_sources)
                for i, record in enumerate(records, start=1)]
    else:
        rows = _read_jsonl(fs, path, uri, mapping, data_sources)
    if not rows:
        raise PromptFileError(f"{uri}: no prompts")
    table = pd.DataFrame(rows, columns=PROMPT_COLUMNS + PROMPT_EXTRAS)
    return table.drop(columns=[c for c in PROMPT_EXTRAS if table[c].isna().all()])


def _read_jsonl(fs, path: str, uri: str, mapping: dict[str, str] | None, data_sources=None) -> list[dict]:
    rows = []
    with fs.open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8").strip()
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{uri}:{line_no}: invalid JSON ({err.msg} at column {err.colno})") from err
            rows.append(_check_row(f"{uri}:{line_no}", row, mapping, data_sources))
    return rows
