"""Held-out format corpus: interaction logs in the shapes teams export, written at test time.

Each ``Shape`` is one real-world layout (the file format, field names and value conventions of a common
export) with a few well-formed rows and its malformed variants, the config that maps it (what a user
writes in a profile or ``-c`` file: no Python), and the expected outcome: rows valid, quarantine reasons,
and the shape route the report names (``StageReport.extra["mapped"]``).
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

LANDING = {"preference": "preferences", "scored": "scored", "feedback": "feedback"}
ASSET = {"preference": "validated_preferences", "scored": "scored_logs", "feedback": "feedback_logs"}
TABLE = {"preference": "preferences.parquet", "scored": "scored.parquet", "feedback": "feedback.parquet"}


@dataclass
class Shape:
    name: str
    description: str
    kind: str
    filename: str
    data: bytes
    config: dict                      # IngestConfig fields (kind is set by the asset / the test)
    rows: int                         # records written
    valid: int
    reasons: dict[str, int]
    route: str                        # the shape route of the valid rows
    duplicates: int = 0
    extra: dict = field(default_factory=dict)


def jsonl(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode()) + b"\n"
                    for r in records)


def parquet(records: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), sink)
    return sink.getvalue()


def arrow(records: list[dict]) -> bytes:
    table = pa.Table.from_pylist(records)
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def csv(header: str, *lines: str) -> bytes:
    return ("\n".join((header,) + lines) + "\n").encode()


def msg(role: str, content) -> dict:
    return {"role": role, "content": content}


def hh(*turns: tuple[str, str]) -> str:
    return "".join(f"\n\n{speaker}: {text}" for speaker, text in turns)


def _pairs() -> list[Shape]:
    flat = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2), "category": "math"}
            for i in range(4)]
    uf = [{"prompt": f"Name colour {i}.", "chosen": [msg("user", f"Name colour {i}."), msg("assistant", "Blue.")],
           "rejected": [msg("user", f"Name colour {i}."), msg("assistant", "Seven.")], "score_chosen": 8.0,
           "score_rejected": 2.0} for i in range(4)]
    trl = [{"prompt": [msg("system", "Be brief."), msg("user", f"Capital of country {i}?")],
            "chosen": [msg("assistant", "Paris.")], "rejected": [msg("assistant", "Bread.")]} for i in range(3)]
    dotted = [{"input": {"text": f"Summarise doc {i}."}, "output": {"good": "Short summary.", "bad": "No."},
               "meta": {"topic": "writing"}} for i in range(3)]
    talk = [("Human", "Hi there."), ("Assistant", "Hello! How can I help?"), ("Human", "Tell me a joke.")]
    return [
        Shape("flat_pairs", "prompt/chosen/rejected JSONL (DPO exports, Argilla)", "preference", "flat.jsonl",
              jsonl(*flat, {**flat[0], "prompt": "Q?", "chosen": "  "}, {**flat[0], "prompt": "Q2?", "chosen": "x",
                    "rejected": "x"}, {"prompt": "Q3?", "chosen": "y"}, flat[1]),
              {}, 8, 4, {"empty_field": 1, "chosen_equals_rejected": 1, "missing_field": 1}, "flat", duplicates=1),
        Shape("renamed_pairs_csv", "CSV with its own column names (question/good/bad)", "preference",
              "renamed.csv", csv("question,good,bad,annotator", "Is 2 even?,Yes.,No.,a1", "Is 3 even?,No.,Yes.,a2",
                                 "Is 4 even?,Yes.,No.,a1,EXTRA", "Is 5 even?,,Yes.,a3"),
              {"field_mapping": {"question": "prompt", "good": "chosen", "bad": "rejected"}}, 4, 2,
              {"invalid_csv_row": 1, "empty_field": 1}, "flat"),
        Shape("ultrafeedback_parquet", "UltraFeedback binarized: chosen/rejected message lists + prompt",
              "preference", "ultrafeedback.parquet",
              parquet(uf + [{**uf[0], "prompt": "Other?", "rejected": [msg("user", "Different question."),
                                                                       msg("assistant", "Seven.")]},
                            {**uf[0], "prompt": "Ends with user?", "chosen": [msg("user", "Name it."),
                                                                              msg("assistant", "Blue."),
                                                                              msg("user", "Why?")]}]),
              {}, 6, 4, {"context_mismatch": 1, "no_final_assistant": 1}, "message_lists"),
        Shape("trl_conversational", "TRL conversational preference: prompt/chosen/rejected all message lists",
              "preference", "trl.jsonl",
              jsonl(*trl, {**trl[0], "chosen": [{"role": "assistant", "content": 42}]},
                    {**trl[1], "rejected": [msg("user", "no answer")]}),
              {}, 5, 3, {"wrong_type": 1, "no_final_assistant": 1}, "message_lists",
              extra={"prompt_messages": True}),
        Shape("hh_rlhf", "Anthropic HH-RLHF: chosen/rejected whole transcripts, no prompt", "preference",
              "hh.jsonl",
              jsonl(*[{"chosen": hh(*talk[:-1], ("Human", f"Joke {i}?"), ("Assistant", "Why did the chicken...")),
                       "rejected": hh(*talk[:-1], ("Human", f"Joke {i}?"), ("Assistant", "No."))} for i in range(3)],
                    {"chosen": hh(("Human", "Q?"), ("Assistant", "A.")), "rejected": hh(("Human", "Other?"),
                                                                                        ("Assistant", "B."))},
                    {"chosen": hh(("Human", "Q?")), "rejected": hh(("Human", "Q?"))},
                    {"chosen": "plain text, no turns", "rejected": "also plain"},
                    {"chosen": hh(("Human", "Hi."), ("Assistant", "")), "rejected": hh(("Human", "Hi."),
                                                                                      ("Assistant", "Go."))}),
              {"transcript": {}}, 7, 3, {"context_mismatch": 1, "no_final_assistant": 1,
                                         "unparsable_transcript": 1, "empty_field": 1}, "hh_transcript",
              extra={"prompt_messages": True}),
        Shape("nested_export", "nested JSON export mapped by dotted paths", "preference", "nested.jsonl",
              jsonl(*dotted, {"input": {"text": "Doc?"}, "output": {"good": "Ok."}}, {"input": "flat?", "output": {
                  "good": "a", "bad": "b"}}),
              {"field_mapping": {"input.text": "prompt", "output.good": "chosen", "output.bad": "rejected",
                                 "meta.topic": "category"}}, 5, 3, {"missing_field": 2}, "flat"),
    ]


def _feedback() -> list[Shape]:
    thumbs = [{"prompt": f"Translate word {i}.", "completion": f"Word {i}.", "label": i % 2 == 0} for i in range(4)]
    conv = [{"messages": [msg("user", f"Plan day {i}."), msg("assistant", "Morning run."), msg("user", "Shorter?"),
                          msg("assistant", "Run.")], "label": "thumbs_up" if i else "thumbs_down"} for i in range(3)]
    return [
        Shape("thumbs_bool", "thumbs feedback: prompt/completion/label true|false (KTO datasets)", "feedback",
              "thumbs.jsonl", jsonl(*thumbs, {**thumbs[0], "completion": "x", "label": "maybe"},
                                    {"prompt": "p", "label": True}, {**thumbs[1], "completion": "y", "label": None}),
              {}, 7, 4, {"unknown_label": 1, "missing_field": 2}, "flat"),
        Shape("thumbs_csv", "thumbs in a CSV export: up/down and 1/0", "feedback", "thumbs.csv",
              csv("prompt,response,vote", "Hi?,Hello.,up", "Bye?,Later.,down", "Sum 1+1?,2,1", "Sum 2+2?,5,0",
                  "Odd?,Hm.,sideways"),
              {"field_mapping": {"response": "completion", "vote": "label"}}, 5, 4, {"unknown_label": 1}, "flat"),
        Shape("feedback_conversations", "a rated chat: messages + label; the last assistant turn is judged",
              "feedback", "conversations.jsonl",
              jsonl(*conv, {"messages": [msg("user", "Hi."), msg("assistant", "Hey."), msg("user", "More?")],
                            "label": "up"}, {"messages": [msg("user", "Hi.")], "label": "up"}),
              {}, 5, 3, {"no_final_assistant": 2}, "conversation", extra={"prompt_messages": True}),
    ]


def _scored() -> list[Shape]:
    stars = [{"prompt": f"Recommend a book ({i % 2}).", "response": f"Book {i}.", "rating": 1 + i % 5,
              "category": "support"} for i in range(6)]
    rewards = [{"prompt": f"Solve {i} * 2.", "completion": str(i * 2), "reward": 1.0} for i in range(3)]
    rewards += [{"prompt": f"Solve {i} * 2.", "completion": str(i * 2 + 1), "reward": 0.0} for i in range(3)]
    talk = [{"messages": [msg("system", "You are terse."), msg("user", "Weather?"),
                          msg("assistant", f"Sunny {i}.")], "score": float(i)} for i in range(3)]
    return [
        Shape("star_ratings", "1-5 star ratings (the seeds' customer-service log): rating -> score", "scored",
              "stars.jsonl", jsonl(*stars, {**stars[0], "response": "Other.", "rating": "five"},
                                   {**stars[0], "response": "None.", "rating": None}),
              {"field_mapping": {"rating": "score"}}, 8, 6, {"wrong_type": 1, "missing_field": 1}, "flat"),
        Shape("thumb_ratings_parquet", "thumbs as the score of a response, text values mapped by score_values",
              "scored", "votes.parquet",
              parquet([{"prompt": "Greet.", "response": r, "vote": v} for r, v in
                       (("Hello!", "up"), ("Go away.", "down"), ("Hi.", "up"), ("Meh.", "sideways"))]),
              {"field_mapping": {"vote": "score"}, "score_values": {"up": 1.0, "down": 0.0}}, 4, 3,
              {"wrong_type": 1}, "flat"),
        Shape("logged_rewards_arrow", "logged completions with a numeric reward (Arrow IPC)", "scored",
              "rewards.arrow", arrow(rewards + [{"prompt": "Solve 9 * 2.", "completion": "18", "reward": float("nan")}]),
              {"field_mapping": {"completion": "response", "reward": "score"}}, 7, 6, {"non_finite_score": 1},
              "flat"),
        Shape("scored_conversations", "OpenAI-style chat logs: messages + score, multi-turn context", "scored",
              "chats.jsonl", jsonl(*talk, {"messages": [msg("user", "Hi.")], "score": 1.0},
                                   {"messages": [msg("user", "Hi."), msg("assistant", "Yo.")], "score": "high"}),
              {}, 5, 3, {"no_final_assistant": 1, "wrong_type": 1}, "conversation", extra={"prompt_messages": True}),
    ]


def corpus() -> list[Shape]:
    return _pairs() + _feedback() + _scored()


def write_shape(shape: Shape, landing_root: str) -> str:
    """Write the shape's file into ``<landing_root>/<kind's landing folder>/``; returns that folder."""
    folder = os.path.join(landing_root, LANDING[shape.kind])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, shape.filename), "wb") as f:
        f.write(shape.data)
    return folder
