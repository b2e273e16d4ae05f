"""Ingest configuration, stage reports and the reject-rate gate.

Everything here is plain data (pydantic / dataclass) so it can travel as Dagster run config and
as asset metadata.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from batchrl.ingest.labels import canonical_label_values

#: Contract fields per kind (strings, required) and the optional metadata kept through the pipeline.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "preference": ("prompt", "chosen", "rejected"),
    "scored": ("prompt", "response", "score"),
    "feedback": ("prompt", "completion", "label"),
}
METADATA_FIELDS: dict[str, tuple[str, ...]] = {
    kind: ("id", "category", "source", "timestamp") for kind in REQUIRED_FIELDS}
#: where each kind's validated rows go: (file name, stage name)
KIND_OUTPUTS = {"preference": ("preferences.parquet", "validate_preferences"),
                "scored": ("scored.parquet", "validate_scored"),
                "feedback": ("feedback.parquet", "validate_feedback")}
Kind = Literal["preference", "scored", "feedback"]

#: Reason codes written to quarantine.parquet (column ``reason``) and counted in ``StageReport.reasons``.
REASONS = {
    # clean_logs: decoding and structure
    "undecodable": "bytes that are not UTF-8 (detail gives the byte offset in the file), or a lone-surrogate "
                   "\\u escape in a text value",
    "invalid_json": "line is not valid JSON",
    "not_object": "record is valid JSON but not an object",
    "missing_field": "a contract field is absent or null (detail names it)",
    "extra_field": "a field outside contract + metadata + mapping (detail names it); only with "
                   "extra_fields: quarantine | error (the default keeps them in the ``extra`` column)",
    "invalid_csv_row": "a CSV line with the wrong number of columns (detail gives expected/actual)",
    "bad_file": "a whole input file could not be read (on_bad_file: skip): truncated compression, damaged "
                "Parquet/Arrow footer, content not matching its extension, permission denied, S3 object "
                "unreadable, header without the contract columns; source_line 0, detail gives the cause",
    "nested_value": "a contract/metadata value is an object or list (records must be flat)",
    "wrong_type": "a value has the wrong type (e.g. number for a text field, text for score, a messages field "
                  "that is not a list of {role, content} objects)",
    "reader_error": "a custom reader rejected the record",
    # log shapes (ingest/shapes.py)
    "unparsable_transcript": "a transcript (IngestConfig.transcript) without turn markers, with text before the "
                             "first marker, or without a user turn before the answer; also a record shaped like "
                             "HH-RLHF (chosen and rejected only, no prompt) whose sides carry no turn markers",
    "no_final_assistant": "a conversation / transcript / message list whose last turn is not the assistant's: "
                          "nothing to train on (detail names the last role)",
    "context_mismatch": "chosen and rejected continue different conversations (their turns before the final "
                        "answer differ)",
    "unknown_label": "a feedback label that is not a known thumbs value (true/false, 1/0, up/down, ...; add "
                     "yours in IngestConfig.label_values)",
    # validate_* / scored_to_pairs: the pandera contract and filters
    "empty_field": "a text field is empty after cleaning (e.g. whitespace only), or an empty list where text or "
                   "messages belong (``rejected: []``)",
    "chosen_equals_rejected": "chosen and rejected are identical after cleaning",
    "non_finite_score": "score is NaN or infinite",
    "prompt_too_long": "prompt longer than max_prompt_tokens with the configured tokenizer",
    "single_response": "scored prompt with fewer than two responses: no pair",
    "below_margin": "best - worst score is 0 or below pair_min_margin",
    "duplicate": "equal to an earlier row in every field of IngestConfig.dedupe_key (default: every logged "
                 "value); counted in .duplicates",
}


class ChatMapping(BaseModel):
    """How chat-style records (lists of ``{role, content}`` messages) become flat text fields.

    Message lists are recognised without this config (its defaults apply); set it for other key/role
    names or to name the conversation field. A contract text field whose value is a message list is
    flattened: completion fields (chosen/rejected/response/completion) take the content of the final
    message, which must be the ``assistant_role``'s; the turns before it become the prompt when the
    record has no prompt of its own (TRL/UltraFeedback conversational style). ``messages_field`` names
    one conversation that provides prompt and completion (scored, feedback) or the prompt only
    (preferences); a record with a ``messages`` list and no prompt is read that way by default. A prompt
    with one user turn is its content; several turns are rendered as ``"{role}: {content}"`` lines joined
    by ``turn_separator`` and kept as messages in ``prompt_messages`` (rendered with the chat template
    downstream)."""

    messages_field: str | None = Field(None, description="field (dotted path) holding one whole conversation; "
                                       "default: 'messages' when the record has no prompt")
    role_key: str = Field("role", description="key of a message's role")
    content_key: str = Field("content", description="key of a message's text")
    assistant_role: str = Field("assistant", description="the role the final message (the completion) must have")
    turn_separator: str = Field("\n", description="text between the 'role: content' lines when several turns "
                                "become the prompt")


class TranscriptFormat(BaseModel):
    """``chosen`` / ``rejected`` are whole dialogue transcripts (Anthropic HH-RLHF style:
    ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``, no prompt field). A turn starts at a marker at the
    text's beginning or after a blank line. The turns both transcripts share become the prompt (multi-turn
    context kept), the final Assistant turn of each the completion. Malformed transcripts are quarantined:
    unparsable_transcript, no_final_assistant, context_mismatch."""

    user_marker: str = Field("Human:", description="marker of a user turn")
    assistant_marker: str = Field("Assistant:", description="marker of an assistant turn")


MAX_DEFAULT_THREADS = 8


def default_threads() -> int:
    """The CPUs this process may run on (cgroup/affinity aware), capped: the ordered dedupe + write stage is
    serial, so past ~8 block workers more threads only add memory."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_THREADS))


class IngestConfig(BaseModel):
    """Configuration of the data plane; defaults work on ``sample_data/``.

    ``field_mapping`` maps a source field (or dotted JSON path, e.g. ``meta.topic``) to a contract or
    metadata field. Any other field (not in the contract, the metadata fields, the mapping or
    ``drop_fields``) is an *extra field*, handled by ``extra_fields``.
    """

    kind: Kind = Field("preference", description="the contract: preference (prompt/chosen/rejected), scored "
                       "(prompt/response/score) or feedback (prompt/completion/label, unpaired thumbs)")
    field_mapping: dict[str, str] = Field(default_factory=dict, description="{source field or dotted path: "
                                          "contract/metadata field}, e.g. {rating: score}")
    chat_mapping: ChatMapping | None = Field(None, description="how chat records (lists of role/content "
                                             "messages) become prompt and completion; message lists are read with "
                                             "its defaults when unset")
    transcript: TranscriptFormat | None = Field(None, description="parse chosen/rejected as whole dialogue "
                                                "transcripts (HH-RLHF); `transcript: {}` takes the HH markers, which are also "
                                                "recognised without it (no prompt, both sides open with '\\n\\nHuman:')")
    label_values: dict[bool | int | float | str, bool] = Field(default_factory=dict, description=(
        "feedback labels -> true/false, e.g. {1: false, 2: false, 4: true, 5: true} for 1-5 ratings; keys are "
        "matched by value (5, '5' and 5.0 are one label; text is case-insensitive) and win over the built-in "
        "true/false, 1/0, up/down, thumbs_up/thumbs_down, good/bad, like/dislike, positive/negative, yes/no"))
    score_values: dict[str, float] = Field(default_factory=dict, description="scores written as text that is "
                                           "not a number, e.g. {up: 1, down: 0} or {'★★★★★': 5}")
    drop_fields: list[str] = Field(default_factory=list, description="source fields dropped before the contract "
                                   "is checked")
    dedupe_key: list[str] | None = Field(None, description=(
        "the fields whose values together make a row a duplicate of an earlier one (counted in duplicates, the "
        "first kept). Default: every logged value, i.e. the contract fields, prompt_messages and extra (log-probs, "
        "rewards and any other field kept beside the contract), so rows that differ in any of them are all kept; "
        "e.g. [prompt, response] keeps one logged completion per prompt and text. Names: the contract fields, "
        "id, category, source, timestamp, prompt_messages, extra"))
    reader: str | None = Field(None, description="a custom reader (module:Class) for formats the built-in readers "
                               "do not know")
    batch_rows: int = Field(65536, description="rows per processing batch (outputs do not depend on it)")
    block_bytes: int = Field(16 << 20, description="JSONL read block in bytes, cut at newlines: the unit of work of "
                             "a worker; memory ~ threads x this (outputs do not depend on it)")
    row_group_rows: int = Field(65536, description="rows per Parquet row group of the outputs, fixed so output "
                                "bytes do not depend on batching")
    collapse_whitespace: bool = Field(False, description="collapse every whitespace run in the text fields to one "
                                      "space (off: it changes code and poems)")
    max_prompt_tokens: int | None = Field(None, description="quarantine rows whose prompt has more tokens "
                                          "(prompt_too_long); none = no limit")
    tokenizer_path: str | None = Field(None, description="tokenizer (tokenizer.json or its folder) that counts "
                                       "max_prompt_tokens; whitespace-separated words when unset")
    reject_threshold: float = Field(0.05, description="log drops: when quarantined / rows in passes this, the "
                                    "drop's blocking reject-rate check fails and preference_window leaves the "
                                    "drop out (scored and feedback logs are not gated)")
    pair_min_margin: float = Field(0.0, description="scored rows paired into preferences (ingest.pairs): best - "
                                   "worst score a prompt needs for a pair; the ingest assets do not pair (the "
                                   "scored_pairs asset has its own)")
    compression: str = Field("snappy", description="Parquet codec of the outputs; snappy writes ~2x faster than "
                             "zstd, zstd is ~30% smaller")
    threads: int = Field(default_factory=default_threads, ge=1,
                         description="JSONL blocks parsed/cleaned in parallel; default: this host's CPUs, at most "
                         "8 (memory ~ threads x block_bytes). Outputs do not depend on it")
    dedupe_memory_keys: int = Field(1 << 19, description="exact-dedupe keys held in memory; past this many they "
                                    "go to sorted run files on disk (Bloom-screened lookups), so memory does not "
                                    "grow with the input")
    dedupe_spill_dir: str | None = Field(None, description="folder of the dedupe spill files; the system temp "
                                         "folder when unset")
    fast_json: bool = Field(True, description="the vectorised JSONL path for clean lines; False forces the "
                            "per-line reference path for all (debugging, equivalence tests)")
    engine: Literal["auto", "duckdb", "arrow"] = Field(
        "auto", description="JSONL block engine: arrow (pyarrow.json) or duckdb (SQL per block; exact only "
        "without field_mapping / chat_mapping, else arrow). Same outputs; auto = arrow, measured faster on 2 cores")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for reading the "
                                            "inputs; the ingest assets set the landing resource's (credentials are "
                                            "redacted in lineage)")
    extra_fields: Literal["keep", "drop", "quarantine", "error"] = Field(
        "keep", description="fields outside contract + metadata + mapping: keep = one JSON object per row in "
        "the nullable ``extra`` column (null values left out), drop = discard (counted), quarantine = reject "
        "the row (reason extra_field), error = the strict contract: a header or first record with an "
        "unknown field is a file error, later such rows are quarantined. Names and counts go to the report.")
    on_bad_file: Literal["fail", "skip"] = Field(
        "fail", description="an input file that cannot be read as a whole (truncated gzip/zstd, damaged "
        "Parquet/Arrow footer, content not matching its extension, permission denied, unreadable S3 object, "
        "header without the contract columns): fail = stop before any output is written, naming every bad "
        "file of the drop; skip = leave it out, one 'bad_file' quarantine entry (source_line 0) with the cause")

    @model_validator(mode="after")
    def _shape_fits_kind(self):
        if self.transcript is not None and self.kind != "preference":
            raise ValueError(f"transcript parses chosen/rejected transcripts into preference pairs; kind is {self.kind!r}")
        if self.label_values and self.kind != "feedback":
            raise ValueError(f"label_values map feedback labels; kind is {self.kind!r} (kind: feedback)")
        if self.score_values and self.kind != "scored":
            raise ValueError(f"score_values map scores; kind is {self.kind!r} (kind: scored)")
        if self.dedupe_key is not None:
            check_dedupe_key(self.dedupe_key, self.kind)
        return self

    @field_validator("label_values", mode="after")
    @classmethod
    def _canonical_labels(cls, values: dict) -> dict[str, bool]:
        return canonical_label_values(values)

    @property
    def required(self) -> tuple[str, ...]:
        return REQUIRED_FIELDS[self.kind]

    @property
    def metadata(self) -> tuple[str, ...]:
        return METADATA_FIELDS[self.kind]

    @property
    def duplicate_key(self) -> tuple[str, ...]:
        """The fields that identify a duplicate row: ``dedupe_key``, or every logged value."""
        return tuple(self.dedupe_key) if self.dedupe_key is not None else default_dedupe_key(self.kind)


#: beside the contract, the values a row's duplicate key covers by default (lineage never: a re-sent row is a copy)
LOGGED_VALUES = ("prompt_messages", "extra")


def default_dedupe_key(kind: str) -> tuple[str, ...]:
    return REQUIRED_FIELDS[kind] + LOGGED_VALUES


def check_dedupe_key(names: list[str], kind: str) -> None:
    """A duplicate key names at least one field of the kind's rows, each once (lineage is not a row value)."""
    allowed = REQUIRED_FIELDS[kind] + METADATA_FIELDS[kind] + LOGGED_VALUES
    unknown = [n for n in names if n not in allowed]
    if not names or unknown or len(set(names)) != len(names):
        problem = f"{unknown} are not fields of {kind} rows" if unknown else "names no field" if not names \
            else "names a field twice"
        raise ValueError(f"dedupe_key {names}: {problem}; choose from {', '.join(allowed)}")


#: where each kind lands and which asset publishes it: (landing folder, asset)
KIND_HOMES = {"preference": ("preferences", "validated_preferences (log_drop)"), "scored": ("scored", "scored_logs"),
              "feedback": ("feedback", "feedback_logs")}


class _OneKindConfig(IngestConfig):
    """The config of an asset that publishes one kind: another ``kind`` is refused when the config is
    written (rows are never published under the wrong name), saying where such logs belong."""

    KIND: ClassVar[str] = "preference"

    @field_validator("kind", mode="before")
    @classmethod
    def _only_own_kind(cls, kind):
        if kind != cls.KIND:
            folder, asset = KIND_HOMES.get(kind, ("?", "?"))
            raise ValueError(
                f"kind {kind!r}: {KIND_HOMES[cls.KIND][1]} holds {cls.KIND} rows ({'/'.join(REQUIRED_FIELDS[cls.KIND])}) "
                f"only; put {kind} logs ({'/'.join(REQUIRED_FIELDS.get(kind, ()))}) in the landing's {folder} folder, "
                f"which the {asset} asset reads")
        return kind


class PreferenceDropConfig(_OneKindConfig):
    """Ingest of one log drop into ``validated_preferences``: the drop must hold preference pairs."""

    # the launchpad lists every kind so that another reaches the validator and its reason is shown
    kind: Kind = Field("preference", description=(
        "'preference' only: a log drop publishes validated_preferences (prompt/chosen/rejected); scored "
        "logs (prompt/response/score) land in the scored landing folder and are read by scored_logs, "
        "feedback (prompt/completion/label) in the feedback folder, read by feedback_logs"))


class ScoredLogsConfig(_OneKindConfig):
    """Ingest of the scored landing into ``scored_logs`` (prompt/response/score): ratings, stars, thumbs
    or numeric rewards mapped to ``score`` by ``field_mapping`` (+ ``score_values`` for text ratings)."""

    KIND: ClassVar[str] = "scored"
    kind: Kind = Field("scored", description="'scored' only: scored_logs holds prompt/response/score rows")


class FeedbackLogsConfig(_OneKindConfig):
    """Ingest of the feedback landing into ``feedback_logs`` (prompt/completion/label): unpaired thumbs."""

    KIND: ClassVar[str] = "feedback"
    kind: Kind = Field("feedback", description="'feedback' only: feedback_logs holds prompt/completion/label rows")


class IngestError(ValueError):
    """A whole input violates the contract (e.g. its header lacks a field); names file, line, fields."""

    def __init__(self, source_file: str, line: int, message: str, missing=(), extra=()):
        self.source_file, self.line = source_file, line
        self.missing, self.extra = list(missing), list(extra)
        parts = [f"{source_file}:{line}: {message}"]
        if self.missing:
            parts.append(f"missing fields {self.missing}")
        if self.extra:
            parts.append(f"extra fields {self.extra}")
        super().__init__("; ".join(parts) + " (map other names with IngestConfig.field_mapping / chat_mapping)")


@dataclass
class StageReport:
    """Row accounting of one stage. Invariant: ``rows_in == valid + quarantined + duplicates``."""

    stage: str
    rows_in: int = 0
    valid: int = 0
    quarantined: int = 0
    duplicates: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    content_hash: str = ""
    # sha256 of each output file, by file name, taken while writing (publishing need not read them again)
    output_sha256: dict[str, str] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def invariant_holds(self) -> bool:
        return self.rows_in == self.valid + self.quarantined + self.duplicates

    @property
    def reject_rate(self) -> float:
        return self.quarantined / self.rows_in if self.rows_in else 0.0

    def count(self, reason: str, n: int = 1) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + n

    def to_metadata(self) -> dict[str, Any]:
        meta = asdict(self)
        del meta["output_sha256"]  # the published artifact's data version stands for them
        meta["reasons"] = dict(sorted(self.reasons.items()))
        meta["reject_rate"] = round(self.reject_rate, 6)
        meta["invariant_holds"] = self.invariant_holds
        meta["seconds"] = round(self.seconds, 3)
        return meta


def check_reject_rate(report: StageReport, threshold: float) -> tuple[bool, str]:
    """Blocking gate: passes when quarantined / rows_in <= threshold and the row invariant holds.

    Duplicates are not rejects (they are counted, not lost). An empty input passes trivially.
    """
    rate = report.reject_rate
    # the most frequent reasons first: they say why the drop failed
    summary = ", ".join(f"{k}={v}" for k, v in sorted(report.reasons.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"
    desc = (f"{report.stage}: {report.quarantined}/{report.rows_in} quarantined ({rate:.2%}, threshold "
            f"{threshold:.2%}); {report.duplicates} duplicates; reasons: {summary}")
    if not report.invariant_holds:
        return False, f"row invariant broken: rows_in={report.rows_in} != valid {report.valid} + " \
                      f"quarantined {report.quarantined} + duplicates {report.duplicates}. " + desc
    if math.isnan(rate) or rate > threshold:
        return False, "reject rate above threshold. " + desc
    return True, desc
