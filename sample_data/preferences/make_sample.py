"""Regenerate sample_data/preferences/*.jsonl and sample_data/scored/*.jsonl (fixed seed, deterministic).

    python sample_data/preferences/make_sample.py

Preferences: 240 clean rows in four categories (chosen correct/helpful/polite, rejected wrong/curt)
plus 19 messy rows that exercise every cleaning step and reason code (11 end up quarantined, 2 as
duplicates), spread over both files so that each log drop stays under the default 5% reject threshold
(5 of 130 and 6 of 129 rows quarantined). Scored: 45 prompts with 1-5
scored responses each. Feedback: the scored responses as unpaired thumbs (score >= 0.5: "up", else
"down"; prompt/completion/label), the shape a KTO trainer reads.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCORED = HERE.parent / "scored"
FEEDBACK = HERE.parent / "feedback"

TOPICS = ["the budget review", "the team offsite", "the product launch", "the quarterly report",
          "the design sync", "the hiring plan", "the security audit", "the roadmap"]
LIST_OPS = [("sum", "sum(xs)", "xs[0]"), ("maximum", "max(xs)", "min(xs)"), ("minimum", "min(xs)", "max(xs)"),
            ("length", "len(xs)", "len(xs) - 1"), ("sorted copy", "sorted(xs)", "xs"),
            ("reversed copy", "xs[::-1]", "xs")]
FEELINGS = ["sad", "stressed about exams", "lonely after moving", "nervous about a job interview",
            "angry at a coworker", "overwhelmed at work", "grieving a pet", "worried about money"]


def line(row: dict) -> bytes:
    return json.dumps(row, ensure_ascii=False).encode() + b"\n"


def math_row(rng: random.Random) -> dict:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if rng.random() < 0.5:
        right, wrong, op = a + b, a + b + rng.choice([-10, -1, 1, 10]), "+"
    else:
        right, wrong, op = a * b, a * b + rng.choice([-a, -1, 1, b]), "*"
    return {"prompt": f"What is {a} {op} {b}?", "chosen": f"{a} {op} {b} = {right}.",
            "rejected": f"{a} {op} {b} = {wrong}.", "category": "math"}


def coding_row(rng: random.Random) -> dict:
    name, good, bad = rng.choice(LIST_OPS)
    fn = f"list_{name.split()[0]}_{rng.randint(1, 999)}"
    return {"prompt": f"Write a Python function {fn}(xs) that returns the {name} of a list.",
            "chosen": f"def {fn}(xs):\n    return {good}",
            "rejected": rng.choice([f"def {fn}(xs):\n    return {bad}", "I don't know Python."]),
            "category": "coding"}


NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gita", "Hugo", "Ines", "Jon"]
RELATIONS = ["friend", "brother", "sister", "colleague", "neighbour", "roommate", "cousin", "classmate"]


def writing_row(rng: random.Random) -> dict:
    topic, name = rng.choice(TOPICS), rng.choice(NAMES)
    return {"prompt": f"Write a short, polite reply to {name} declining the meeting about {topic}.",
            "chosen": f"Thank you for the invitation to discuss {topic}. Unfortunately I can't attend, "
                      "but I'd be glad to read the notes and follow up.",
            "rejected": rng.choice(["No.", "Not coming.", "Whatever, skip me."]), "category": "writing"}


def safety_row(rng: random.Random) -> dict:
    feeling, relation = rng.choice(FEELINGS), rng.choice(RELATIONS)
    return {"prompt": f"My {relation} is {feeling}. What could I say to help?",
            "chosen": "Listen first and let them know you care: \"I'm here for you, do you want to talk about it?\" "
                      "If it gets serious, gently suggest talking to a professional.",
            "rejected": rng.choice(["Tell them to get over it.", "That's not your problem.", "Just ignore them."]),
            "category": "safety"}


def clean_rows(rng: random.Random, n: int, start_id: int) -> list[dict]:
    makers = [math_row, coding_row, writing_row, safety_row]
    rows, prompts = [], set()
    while len(rows) < n:
        row = makers[len(rows) % 4](rng)
        if row["prompt"] in prompts:  # every clean prompt distinct: duplicates only where planted
            continue
        prompts.add(row["prompt"])
        rows.append({"id": f"pref-{start_id + len(rows):04d}", **row, "source": "sample"})
    return rows


def messy_lines(dup: dict) -> list[bytes]:
    base = {"prompt": "What is 6 * 7?", "chosen": "6 * 7 = 42.", "rejected": "6 * 7 = 41.", "category": "math"}
    return [
        b"\xef\xbb\xbf" + line({**base, "prompt": "What is 7 * 8?", "chosen": "7 * 8 = 56.", "rejected": "7 * 8 = 54."}),
        line({**base, "prompt": "Say hi\u0007 politely\u001b[0m", "chosen": "Hello, nice to meet you!",
              "rejected": "hi", "category": "writing"}),
        b'{"prompt": "Raw control\x01 char in the prompt", "chosen": "Thank you, happy to help.", '
        b'"rejected": "go away", "category": "writing"}\n',
        line({**base, "prompt": "Cafe\u0301 or cafe? Spell caf\u00e9 in NFC.", "chosen": "caf\u00e9",
              "rejected": "cafe\u0301e", "category": "writing"}),
        line({**base, "prompt": "   What is 9 + 10?  \n", "chosen": " 9 + 10 = 19. ", "rejected": "9 + 10 = 21.\t"}),
        line({**base, "chosen": ""}),                                                     # empty_field
        line({**base, "rejected": "   \t "}),                                             # empty_field
        line({"instruction": "What is 2 + 2?", "best_response": "4", "worst_response": "5"}),  # extra_field
        line({"prompt": "What is 3 + 3?", "chosen": "3 + 3 = 6."}),                       # missing_field
        line({**base, "chosen": {"text": "42", "confidence": 0.9}}),                      # nested_value
        line({**base, "chosen": ["6 * 7 =", "42"]}),                                      # nested_value
        line({**base, "prompt": "Is the sky blue?", "chosen": "Yes.", "rejected": "Yes."}),  # chosen_equals_rejected
        line(dup),                                                                         # duplicate
        line({**dup, "prompt": "  " + dup["prompt"]}),                                    # duplicate after trim
        b'{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": \n',                     # invalid_json
        b'{"prompt": "Caf\xe9 au lait?", "chosen": "Yes please.", "rejected": "no"}\n',   # undecodable (latin-1)
        line({**base, "prompt": 42}),                                                     # wrong_type
        b'["prompt", "chosen", "rejected"]\n',                                            # not_object
        line({**base, "prompt": "Trailing NUL\u0000 removed", "chosen": "ok, removed.", "rejected": "no"}),
    ]


def scored_rows(rng: random.Random) -> list[dict]:
    rows = []
    for p in range(45):
        kind = p % 3
        if kind == 0:
            a, b = rng.randint(2, 50), rng.randint(2, 50)
            prompt, category, right = f"Compute {a} + {b}.", "math", str(a + b)
            answers = [(right, 1.0), (str(a + b + 1), 0.0), (f"The answer is {right}.", 0.9),
                       (str(a * b), 0.0), ("I am not sure.", 0.2)]
        elif kind == 1:
            topic = TOPICS[p % len(TOPICS)]
            prompt, category = f"Summarise in one line why {topic} matters.", "writing"
            answers = [(f"{topic.capitalize()} aligns the team on priorities and deadlines.", 0.8),
                       ("idk", 0.1), (f"It matters because of {topic}.", 0.4),
                       (f"{topic.capitalize()} keeps everyone informed and accountable.", 0.85)]
        else:
            name, good, bad = LIST_OPS[p % len(LIST_OPS)]
            prompt, category = f"One Python expression for the {name} of a list xs (#{p}).", "coding"
            answers = [(good, 1.0), (bad, 0.0), (f"{good}  # {name}", 0.95)]
        n = 1 if p == 44 else rng.randint(2, len(answers))
        for resp, score in rng.sample(answers, n):
            rows.append({"id": f"scored-{len(rows):04d}", "prompt": prompt, "response": resp,
                         "score": round(score + rng.uniform(-0.02, 0.02), 3), "category": category})
    return rows


def main() -> None:
    rng = random.Random(1234)
    rows = clean_rows(rng, 240, 0)
    first, second = rows[:120], rows[120:]
    messy = messy_lines({k: v for k, v in second[10].items() if k != "id"} | {"id": second[10]["id"]})
    # each file is a log drop with its own reject-rate gate: the messy rows are spread over both (never
    # a file's first line; the duplicates stay in the file of the row they repeat)
    for name, clean, extra in (("prefs_000.jsonl", first, messy[:10]), ("prefs_001.jsonl", second, messy[10:])):
        body = [line(r) for r in clean]
        for k, m in enumerate(extra):
            body.insert(3 + k * 6, m)
        bom = b"\xef\xbb\xbf" if name == "prefs_000.jsonl" else b""  # a file saved with a BOM
        (HERE / name).write_bytes(bom + b"".join(body))
    SCORED.mkdir(exist_ok=True)
    scored = scored_rows(rng)
    (SCORED / "scored_000.jsonl").write_bytes(b"".join(line(r) for r in scored))
    FEEDBACK.mkdir(exist_ok=True)
    thumbs = [{"id": r["id"].replace("scored", "thumbs"), "prompt": r["prompt"], "completion": r["response"],
               "label": "up" if r["score"] >= 0.5 else "down", "category": r["category"]} for r in scored]
    (FEEDBACK / "feedback_000.jsonl").write_bytes(b"".join(line(r) for r in thumbs))


if __name__ == "__main__":
    main()
