"""Log shapes: how one source record becomes the contract's fields, beyond renames.

``ShapeMapper.apply`` runs on a record after ``field_mapping`` (``RecordStructurer``) and returns the
*route* the row took, counted per stage in the report (``StageReport.extra["mapped"]``):

- ``flat``: the contract fields came as strings (after renames);
- ``message_lists``: chosen/rejected/response/completion (and maybe prompt) as ``{role, content}`` lists
  (UltraFeedback, TRL conversational): the final message, which must be the assistant's, is the
  completion; the turns before it the prompt, the same for both sides of a pair;
- ``conversation``: one ``messages`` list (``ChatMapping.messages_field``, or ``messages`` when the
  record has no prompt): the last assistant message is the trained turn, every earlier turn the context;
- ``hh_transcript``: ``chosen``/``rejected`` as whole ``Human:``/``Assistant:`` transcripts
  (``IngestConfig.transcript``; recognised without it when a record has no prompt and both sides open with
  ``"\n\nHuman:"``): the shared turns are the prompt.

A multi-turn prompt is kept as messages (``prompt_messages``, JSON) for the chat template and rendered as
``role: content`` lines in ``prompt``. Labels (feedback) and text ratings (scored) are mapped here too.
Every refusal is a ``RowError`` with a reason code of ``config.REASONS``.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
import pyarrow as pa

from batchrl.ingest.row_error import RowError
from batchrl.ingest.config import ChatMapping, IngestConfig, TranscriptFormat
from batchrl.ingest.labels import BUILTIN_LABELS, thumbs  # noqa: F401 (BUILTIN_LABELS: re-exported)

COMPLETIONS = {"preference": ("chosen", "rejected"), "scored": ("response",), "feedback": ("completion",)}
AUTO_MESSAGES_FIELD = "messages"


def _row_error(reason: str, detail: str):

    return RowError(reason, detail)


def get_path(obj: dict, path: str) -> tuple[bool, Any]:
    """(found, value) of a dotted path into nested objects."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


class ShapeMapper:
    """The shape part of structuring one record (see module doc); thread-safe (no state per record)."""

    def __init__(self, cfg: IngestConfig):
        self.cfg = cfg
        self.chat = cfg.chat_mapping or ChatMapping()
        self.messages_field = self.chat.messages_field
        self.completions = COMPLETIONS[cfg.kind]
        self.labels = dict(cfg.label_values)  # canonical keys (ingest.labels), looked up before the built-in ones
        self.scores = {k.strip().lower(): v for k, v in cfg.score_values.items()}
        # HH transcripts are parsed when configured, and recognised without config (the HH markers) in a
        # preference record with no prompt whose chosen and rejected both open with "\n\nHuman:"
        self.transcript = cfg.transcript or TranscriptFormat()
        markers = "|".join(re.escape(m) for m in (self.transcript.user_marker, self.transcript.assistant_marker))
        self.turn_re = re.compile(rf"(?:^|\n\n)({markers})")
        self.hh_opening = "\n\n" + self.transcript.user_marker

    def conversation_field(self, obj: dict) -> str | None:
        """The field holding the record's conversation: configured, or ``messages`` when the record has a
        message list there and no prompt of its own (then that field is consumed, not an extra field)."""
        if self.messages_field:
            return self.messages_field
        if "prompt" not in obj and self.is_messages(obj.get(AUTO_MESSAGES_FIELD)) and AUTO_MESSAGES_FIELD not in \
                self.cfg.field_mapping:
            return AUTO_MESSAGES_FIELD
        return None

    def is_messages(self, value: Any) -> bool:
        """A non-empty list of objects that each have the role and content keys."""
        keys = (self.chat.role_key, self.chat.content_key)
        return isinstance(value, list) and bool(value) and all(
            isinstance(m, dict) and all(k in m for k in keys) for m in value)

    # -- routes --------------------------------------------------------------------------------
    def apply(self, obj: dict, row: dict) -> str:
        """Fill ``row``'s contract fields (and ``prompt_messages``) from the record's shape; the route."""
        if self.cfg.transcript is not None or self._looks_like_hh(row):
            return self._transcripts(row)
        route = "flat"
        context = None
        field = self.conversation_field(obj)
        if field is not None:
            found, messages = get_path(obj, field)
            if found and self.is_messages(messages):
                route = "conversation"
                target = self.completions[0]
                if self.cfg.kind != "preference" and row.get(target) is None:
                    context, row[target] = self._split_final(field, messages)
                else:
                    context = messages
        contexts = []
        for name in self.completions:
            if self.is_messages(row.get(name)):
                route = "message_lists" if route == "flat" else route
                before, row[name] = self._split_final(name, row[name])
                contexts.append((name, before))
        if len(contexts) == 2 and self._turns(contexts[0][1]) != self._turns(contexts[1][1]):
            raise _row_error("context_mismatch", "chosen and rejected continue different conversations "
                                                 "(their turns before the final answer differ)")
        if context is None and contexts and contexts[0][1]:
            context = contexts[0][1]
        if self.is_messages(row.get("prompt")):
            route = "message_lists" if route == "flat" else route
            row["prompt"], row["prompt_messages"] = self._render("prompt", row["prompt"])
        elif row.get("prompt") is None and context:
            row["prompt"], row["prompt_messages"] = self._render("prompt", context)
        return route

    # -- why contract fields are missing ---------------------------------------------------------
    def why_missing(self, obj: dict, row: dict, extra: list[str]):
        """A ``RowError`` that says better than missing_field why a record gave no contract fields, or None:
        its conversation field is not a message list, or it is shaped like HH-RLHF (chosen and rejected only)
        but its sides are not transcripts."""
        field = self.messages_field or (AUTO_MESSAGES_FIELD if "prompt" not in obj and AUTO_MESSAGES_FIELD not in
                                        self.cfg.field_mapping else None)
        found, value = get_path(obj, field) if field else (False, None)
        if found and not self.is_messages(value):
            return self._not_messages(field, value)
        if self._hh_shaped(row) and not extra:
            for name in ("chosen", "rejected"):
                self.parse_transcript(name, row[name])  # raises with where the transcript breaks
            return _row_error("unparsable_transcript", "chosen/rejected are transcripts but do not open with "
                                                       f"{self.hh_opening!r}: set transcript: {{}} to parse them")
        return None

    def _not_messages(self, field: str, value: Any):
        keys = f"{{{self.chat.role_key}, {self.chat.content_key}}}"
        if isinstance(value, list) and not value:
            return _row_error("empty_field", f"{field} is an empty list: no message to train on")
        if not isinstance(value, list):
            return _row_error("wrong_type", f"{field} must be a list of {keys} messages, got a "
                                            f"{type(value).__name__}")
        bad = next(i for i, m in enumerate(value) if not (isinstance(m, dict) and self.chat.role_key in m
                                                         and self.chat.content_key in m))
        return _row_error("wrong_type", f"{field}[{bad}] is not a {keys} message (set chat_mapping for other keys)")

    def _hh_shaped(self, row: dict) -> bool:
        # no prompt field at all nor one mapped (a null or unfound one is missing_field), both sides text
        return (self.cfg.kind == "preference" and "prompt" not in row and "prompt" not in self.cfg.field_mapping.values()
                and all(isinstance(row.get(n), str) for n in ("chosen", "rejected")))

    def _looks_like_hh(self, row: dict) -> bool:
        return (self.cfg.kind == "preference" and row.get("prompt") is None
                and all(isinstance(row.get(n), str) and row[n].startswith(self.hh_opening) for n in ("chosen", "rejected")))

    def _turns(self, messages: list) -> list[tuple[Any, Any]]:
        return [(m.get(self.chat.role_key), m.get(self.chat.content_key)) for m in messages]

    def _split_final(self, name: str, messages: list) -> tuple[list, str]:
        """(turns before the final message, its content); the final message must be the assistant's."""
        last = messages[-1]
        role = last.get(self.chat.role_key)
        if role != self.chat.assistant_role:
            raise _row_error("no_final_assistant", f"{name}: the last message is {role!r}, not "
                                                   f"{self.chat.assistant_role!r}: nothing to train on")
        content = last.get(self.chat.content_key)
        if not isinstance(content, str):
            raise _row_error("wrong_type", f"{name}[{len(messages) - 1}].{self.chat.content_key} is not a string")
        return messages[:-1], content

    def _render(self, name: str, turns: list) -> tuple[str, str | None]:
        """(prompt text, messages JSON or None): one user turn is its content; more are kept as messages."""
        parts = []
        for i, (role, content) in enumerate(self._turns(turns)):
            if not isinstance(content, str):
                raise _row_error("wrong_type", f"{name}[{i}].{self.chat.content_key} is not a string")
            if not isinstance(role, str):
                raise _row_error("wrong_type", f"{name}[{i}].{self.chat.role_key} is not a string")
            parts.append((role, content))
        if len(parts) == 1 and parts[0][0] != self.chat.assistant_role:
            return parts[0][1], None
        messages = [{"role": role, "content": content} for role, content in parts]
        text = self.chat.turn_separator.join(f"{role}: {content}" for role, content in parts)
        return text, json.dumps(messages, ensure_ascii=False)

    def _transcripts(self, row: dict) -> str:
        sides = []
        for name in ("chosen", "rejected"):
            value = row.get(name)
            if value is None:
                raise _row_error("missing_field", f"missing or null fields: {name}")
            if not isinstance(value, str):
                raise _row_error("wrong_type", f"{name} is {type(value).__name__}, expected a transcript string")
            sides.append(self.parse_transcript(name, value))
        (context, row["chosen"]), (other, row["rejected"]) = sides
        if context != other:
            raise _row_error("context_mismatch", "chosen and rejected transcripts differ before their final "
                                                 "Assistant turn")
        if row.get("prompt") is None:
            row["prompt"], row["prompt_messages"] = self._render("prompt", context)
        return "hh_transcript"

    def parse_transcript(self, name: str, text: str) -> tuple[list[dict], str]:
        """(context turns as messages, final assistant text) of one transcript."""
        t = self.transcript
        pieces = self.turn_re.split(text)  # [before, marker, content, marker, content, ...]
        if len(pieces) < 3 or pieces[0].strip():
            where = "no turn markers" if len(pieces) < 3 else "text before the first turn marker"
            raise _row_error("unparsable_transcript", f"{name}: {where} ({t.user_marker!r} / {t.assistant_marker!r})")
        turns = [{"role": "user" if marker == t.user_marker else self.chat.assistant_role, "content": content.strip()}
                 for marker, content in zip(pieces[1::2], pieces[2::2])]
        if turns[-1]["role"] != self.chat.assistant_role:
            raise _row_error("no_final_assistant", f"{name}: the transcript ends with a {t.user_marker!r} turn")
        if not any(m["role"] == "user" for m in turns[:-1]):
            raise _row_error("unparsable_transcript", f"{name}: no {t.user_marker!r} turn before the answer")
        return turns[:-1], turns[-1]["content"]

    # -- values --------------------------------------------------------------------------------
    def label(self, value: Any) -> bool:
        """A thumbs value as a bool (True = desirable): ``label_values`` first, whatever the label's type."""
        if isinstance(value, (dict, list)):
            raise nested_error("label", value)
        flag = thumbs(value, self.labels)
        if flag is None:
            raise _row_error("unknown_label", f"label {value!r} is not a known thumbs value (true/false, 1/0, "
                                              "up/down, ...): add it to label_values")
        return flag

    def score(self, value: Any) -> float:
        """A rating as a float: numbers as they are, text through ``score_values`` or as a number."""
        if isinstance(value, (dict, list)):
            raise nested_error("score", value)
        if isinstance(value, str) or isinstance(value, bool):
            key = str(value).strip().lower()
            if key in self.scores:
                return float(self.scores[key])
            if isinstance(value, str):
                number = text_number(value)
                if number is not None:
                    return number
            raise _row_error("wrong_type", f"score {value!r} is not a number (map text ratings with score_values)")
        if not isinstance(value, (int, float)):
            raise _row_error("wrong_type", f"score is {type(value).__name__}, expected a number")
        try:
            return float(value)
        except OverflowError:
            return math.copysign(math.inf, value)

    # -- whole columns (the vectorised path of flat tables) -------------------------------------
    def score_column(self, col: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """(float64 scores, rows whose non-null text is neither a mapped rating nor a number)."""
        values = col.to_pylist()
        out, bad = [], np.zeros(len(values), bool)
        for i, v in enumerate(values):
            number = None if v is None else self.scores.get(v.strip().lower(), text_number(v))
            out.append(None if number is None else float(number))
            bad[i] = v is not None and number is None
        return pa.array(out, pa.float64()), bad

    def label_column(self, col: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """(bool labels, rows that are not a thumbs value) of a bool, number or text column."""
        if pa.types.is_boolean(col.type) and not {"true", "false"} & set(self.labels):
            return col, np.zeros(len(col), bool)
        values = col.to_pylist()
        out, bad = [], np.zeros(len(values), bool)
        for i, v in enumerate(values):
            try:
                out.append(None if v is None else self.label(v))
            except Exception:  # noqa: BLE001 - a RowError: the row is flagged below
                out.append(None)
                bad[i] = True
        return pa.array(out, pa.bool_()), bad


def flat_shape(cfg: IngestConfig) -> bool:
    """Whether every valid record of this config is flat text + numbers the vectorised paths map exactly
    (JSONL blocks, columnar tables): no chat mapping, dotted paths, transcripts, labels, text ratings or
    mapped fields carried in ``extra``.
    Other records (message lists, a ``messages`` conversation) are nested and go to the per-record path."""
    return (cfg.chat_mapping is None and cfg.transcript is None and cfg.kind != "feedback"
            and not cfg.score_values and not any("." in k for k in cfg.field_mapping)
            and not carried_fields(cfg))


def carried_fields(cfg: IngestConfig) -> dict[str, str]:
    """{source path: name} of mapped fields outside contract + metadata: they travel in ``extra`` under the
    mapped name whatever ``extra_fields`` says (the mapping asks for them; e.g. logged log-probs -> logprobs)."""
    known = set(cfg.required) | set(cfg.metadata)
    return {path: name for path, name in cfg.field_mapping.items() if name not in known}


def nested_error(name: str, value: Any):
    """The refusal of an object/list where a flat value belongs; an empty one says so (nothing to train on)."""
    if not value:
        return _row_error("empty_field", f"{name} is an empty {'list' if isinstance(value, list) else 'object'}")
    return _row_error("nested_value", f"{name} is an object/list; records must be flat")


def text_number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None
