"""Input shared by the ingest tests (test_ingest_fastpath, test_ingest_onepass): JSONL with every kind of line the
cleaner must handle."""
from __future__ import annotations

import json
import random


def tricky_lines(n: int = 3000, seed: int = 7) -> bytes:
    """``n`` seeded JSONL lines: unicode (composed and not), control characters, truncated lines, nested values,
    wrong types, extra fields, a BOM mid-file, undecodable bytes, blank and whitespace-only lines, CRLF."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "café", "cafe\u0301", "数据", "x\u0007y", "tab\tin", "line\nbreak", "\u0085nel",
             "{braces}", "[list]", "colon: {x}", "quote\"d", "back\\slash", "  pad  ", "\u212b"]
    out = []
    for i in range(n):
        row = {"prompt": " ".join(rng.choices(words, k=4)), "chosen": rng.choice(words) + str(i),
               "rejected": rng.choice(words) + str(-i)}
        if rng.random() < 0.3:
            row["category"] = rng.choice(["a", "b"])
        kind = rng.random()
        line = json.dumps(row, ensure_ascii=rng.random() < 0.5).encode()
        if kind < 0.02:
            line = line[: len(line) // 2]                      # truncated
        elif kind < 0.04:
            row["chosen"] = {"nested": True}
            line = json.dumps(row).encode()
        elif kind < 0.06:
            row["prompt"] = 12
            line = json.dumps(row).encode()
        elif kind < 0.08:
            row["extra"] = "x"
            line = json.dumps(row).encode()
        elif kind < 0.09:
            line = b"\xef\xbb\xbf" + line                       # BOM mid-file
        elif kind < 0.10:
            line = line.replace(b"alpha", b"al\xffpha") if b"alpha" in line else b"\xfe" + line
        elif kind < 0.11:
            line = b""                                          # blank line
        elif kind < 0.12:
            line = b"   "                                       # whitespace-only line
        elif kind < 0.13:
            line = line + b"\r"                                 # CRLF
        elif kind < 0.14:
            row["source"] = 5
            line = json.dumps(row).encode()
        out.append(line)
    return b"\n".join(out) + b"\n"
