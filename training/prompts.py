"""Prompt sets for rollouts: JSONL rows with ``prompt`` (+ optional ``answer``, ``category``, ``id``)."""
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


def _check_row(uri: str, line_no: int, row: Any) -> dict:
    if not isinstance(row, dict):
        raise PromptFileError(f"{uri}:{line_no}: expected a JSON object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptFileError(f"{uri}:{line_no}: field 'prompt' must be a non-empty string, got {prompt!r}")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise PromptFileError(f"{uri}:{line_no}: field 'answer' must be a string or number, got {answer!r}")
    prompt_id = row.get("id") or hashlib.sha256(prompt.encode()).hexdigest()[:16]
    data_source, tests = row.get("data_source"), row.get("tests")
    if data_source is not None and not isinstance(data_source, str):
        raise PromptFileError(f"{uri}:{line_no}: field 'data_source' must be a string, got {data_source!r}")
    if tests is not None and not isinstance(tests, (list, dict)):
        raise PromptFileError(f"{uri}:{line_no}: field 'tests' must be a list of test statements or "
                              f"{{'inputs': [...], 'outputs': [...]}}, got {type(tests).__name__}")
    return {"prompt_id": str(prompt_id), "prompt": prompt.strip(),
            "answer": None if answer is None else str(answer), "category": row.get("category"),
            "data_source": data_source, "tests": None if tests is None else json.dumps(tests)}


def load_prompts(uri: str, storage_options: dict | None = None) -> pd.DataFrame:
    """Read a JSONL prompt file (local or s3://), failing on the first bad line with file:line:field."""
    fs, path = fsutil.filesystem_for(uri, storage_options)
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
            rows.append(_check_row(uri, line_no, row))
    if not rows:
        raise PromptFileError(f"{uri}: no prompts")
    table = pd.DataFrame(rows, columns=PROMPT_COLUMNS + PROMPT_EXTRAS)
    return table.drop(columns=[c for c in PROMPT_EXTRAS if table[c].isna().all()])
