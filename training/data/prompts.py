"""Prompt sets for rollouts: JSONL or Parquet rows with ``prompt`` (+ optional ``answer``, ``category``,
``id``, ``data_source``, ``tests``).

``mapping`` renames fields on the way in, with dotted paths into nested records, so verl-format
Parquet (``prompt`` as a chat, ``data_source``, ``reward_model: {style, ground_truth}``) loads with
``{"reward_model.ground_truth": "answer"}`` and GSM8K files with ``{"question": "prompt"}``.

A chat ``prompt`` (``{role, content}`` messages; roles system, user, assistant; ending with the user's turn)
of one user message becomes its text, like a plain prompt. A longer chat is kept as messages: the
``prompt_messages`` column (JSON, as the ingested logs carry their contexts) is what every rollout engine
renders with the model's chat template (``training.text.render_prompt``), and ``prompt`` holds its
``role: content`` lines for display, rewards and the default id (which hashes the messages, so two chats that
end with the same question in different conversations are different prompts). A chat that ends with the
assistant, or whose messages have another shape, is refused here with file, row and field named.

``data_sources`` names the ``data_source`` values the set may carry: a row with another is refused here,
when the prompts are validated (verl's reward manager fails on it only when rewards run).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import pandas as pd

from batchrl.common import fsutil
from batchrl.training.data.prompt_shapes import PromptQuarantine, QuarantinedPrompt, shape_row

PROMPT_COLUMNS = ["prompt_id", "prompt", "answer", "category"]
# Optional per-prompt fields carried to the rewards: where the prompt comes from (reward routing,
# as verl's data_source), the code-execution reward's tests (kept as JSON text) and a multi-turn
# prompt's messages (JSON text; a column only when some prompt is a chat of more than one message).
PROMPT_EXTRAS = ["data_source", "tests", "prompt_messages"]
CHAT_ROLES = ("system", "user", "assistant")


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


def _chat(where: str, prompt: Any) -> tuple[Any, str | None]:
    """(prompt text, messages JSON or None) of a ``prompt`` field: a string stays itself, a single user message
    becomes its content, a longer chat its ``role: content`` lines and its messages."""
    if not isinstance(prompt, (list, tuple)):
        return prompt, None
    if not prompt:
        raise PromptFileError(f"{where}: field 'prompt' is an empty chat")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise PromptFileError(f"{where}: field 'prompt[{i}]' must be a {{role, content}} message, "
                                  f"got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise PromptFileError(f"{where}: field 'prompt[{i}].role' must be one of {list(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):  # e.g. a list of multimodal parts: the chat templates here render text
            raise PromptFileError(f"{where}: field 'prompt[{i}].content' must be a string, "
                                  f"got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    last = len(messages) - 1
    if messages[last]["role"] != "user":
        raise PromptFileError(f"{where}: field 'prompt[{last}].role' is {messages[last]['role']!r}: a chat prompt "
                              "must end with the user's turn, the one the policy answers")
    if not messages[last]["content"].strip():
        raise PromptFileError(f"{where}: field 'prompt[{last}].content' is empty: the user's last turn has no text")
    if len(messages) == 1:
        return messages[0]["content"], None
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return text, json.dumps(messages, ensure_ascii=False)


def _check_row(where: str, row: Any, mapping: dict[str, str] | None = None,
               data_sources: frozenset[str] | None = None, shape: str = "plain", suffix: str | None = None) -> dict:
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    row = shape_row(apply_mapping(row, mapping), shape, suffix)
    prompt, messages = _chat(where, row.get("prompt"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptFileError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise PromptFileError(f"{where}: field 'answer' must be a string or number, got {answer!r}")
    # a chat's id hashes its messages: its text alone could equal a plain prompt's
    prompt_id = row.get("id") or hashlib.sha256((messages or prompt).encode()).hexdigest()[:16]
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
            "data_source": data_source, "tests": None if tests is None else json.dumps(tests),
            "prompt_messages": messages}


def load_prompts(uri: str, storage_options: dict | None = None, mapping: dict[str, str] | None = None,
                 data_sources=None, shape: str = "plain", suffix: str | None = None,
                 quarantine: PromptQuarantine | None = None) -> pd.DataFrame:
    """Read a JSONL (``.gz`` too) or Parquet prompt file (local or s3://), failing on the first bad line/row with
    file:line (or row):field; ``mapping`` and ``data_sources`` as in the module docstring; ``shape`` and
    ``suffix`` as in ``training.prompt_shapes``. A row the shape quarantines (e.g. a GSM8K row without ``####``)
    goes to ``quarantine`` with its reason when one is given, else fails the load naming it."""
    data_sources = None if data_sources is None else frozenset(data_sources)
    fs, path = fsutil.filesystem_for(uri, storage_options)
    options = dict(mapping=mapping, data_sources=data_sources, shape=shape, suffix=suffix)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            records = pq.read_table(f).to_pylist()
        located = ((f"{uri}: row {i}", record, json.dumps(record, default=str)) for i, record in enumerate(records, 1))
    else:
        located = _jsonl_records(fs, path, uri)
    rows = []
    for where, record, raw in located:
        try:
            rows.append(_check_row(where, record, **options))
        except QuarantinedPrompt as err:
            if quarantine is None:
                raise PromptFileError(f"{where}: {err}") from None
            quarantine.add(where, err.reason, err.detail, raw)
    if not rows:
        raise PromptFileError(f"{uri}: no prompts" + (f" ({len(quarantine.rows)} quarantined: {quarantine.reasons()})"
                                                      if quarantine and quarantine.rows else ""))
    table = pd.DataFrame(rows, columns=PROMPT_COLUMNS + PROMPT_EXTRAS)
    return table.drop(columns=[c for c in PROMPT_EXTRAS if table[c].isna().all()])


def _jsonl_records(fs, path: str, uri: str):
    """(where, parsed row, raw line) of each non-empty line; gzip when the name ends in ``.gz``."""
    with fs.open(path, "rb", compression="gzip" if path.endswith(".gz") else None) as f:
        for line_no, raw in enumerate(f, start=1):
            text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8").strip()
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{uri}:{line_no}: invalid JSON ({err.msg} at column {err.colno})") from err
            yield f"{uri}:{line_no}", row, text
