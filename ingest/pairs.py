"""scored_to_pairs: scored interaction logs -> preference pairs (best vs worst response per prompt).

Per prompt (exact string after cleaning): chosen = highest score, rejected = lowest score; ties go to
the earlier row (source_file, source_line). A pair needs >= 2 responses and a margin
``best - worst > 0`` and ``>= pair_min_margin``. Category comes from the chosen row (else the rejected).
Unit of account is the prompt group: rows_in = groups, valid = pairs written, quarantined = groups
without a pair (``single_response``/``below_margin``) or pairs failing the preference contract,
duplicates = duplicate pairs. Pairs go through the same pandera contract as logged preferences.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pydantic import BaseModel, Field

from batchrl.common.fsutil import duckdb_for
from batchrl.ingest.config import IngestConfig, StageReport
from batchrl.ingest.validate import cleaned_files, run_contract
from batchrl.schemas import PREFERENCE_ARROW, QUARANTINE_ARROW, SCORED_ARROW

PAIRS_SQL = """
WITH s AS (
  SELECT *, row_number() OVER (ORDER BY source_file, source_line) AS ord FROM scored
), r AS (
  SELECT *, count(*) OVER w AS n, min(ord) OVER w AS first_ord,
         row_number() OVER (PARTITION BY prompt ORDER BY score DESC, ord) AS best_rank,
         row_number() OVER (PARTITION BY prompt ORDER BY score ASC, ord) AS worst_rank
  FROM s WINDOW w AS (PARTITION BY prompt)
)
SELECT b.prompt, b.response AS chosen, w.response AS rejected, b.score AS chosen_score,
       w.score AS rejected_score, b.n AS n_responses, coalesce(b.category, w.category) AS category,
       b.source, b.timestamp, b.extra, b.prompt_messages, b.source_file, b.source_line, b.id AS chosen_id, w.id AS rejected_id
FROM r b JOIN r w ON b.prompt = w.prompt AND b.best_rank = 1 AND w.worst_rank = 1
ORDER BY b.first_ord
"""


class PairsConfig(BaseModel):
    """How scored logs become preference pairs (the ``scored_pairs`` asset's config)."""

    pair_min_margin: float = Field(0.0, ge=0.0, description=(
        "a prompt gives a pair only when best score - worst score > 0 and >= this margin; other prompts are "
        "quarantined as below_margin"))


def _split(batch: pa.Table, min_margin: float) -> tuple[pa.Table, pa.Table]:
    n = batch.column("n_responses").to_numpy()
    margin = batch.column("chosen_score").to_numpy() - batch.column("rejected_score").to_numpy()
    single = n < 2
    low = ~single & ((margin <= 0) | (margin < min_margin))
    bad = np.flatnonzero(single | low)
    pairs = batch.filter(pa.array(~(single | low)))
    pairs = pa.table({
        "id": pa.nulls(pairs.num_rows, pa.string()),
        **{c: pairs.column(c) for c in PREFERENCE_ARROW.names if c != "id"},
    }, schema=PREFERENCE_ARROW)
    if not len(bad):
        return pairs, QUARANTINE_ARROW.empty_table()
    rows = batch.take(pa.array(bad)).to_pylist()
    reasons = ["single_response" if single[i] else "below_margin" for i in bad]
    details = [f"{r['n_responses']} response(s); best {r['chosen_score']} worst {r['rejected_score']} "
               f"(min margin {min_margin})" for r in rows]
    raws = [json.dumps({k: r[k] for k in ("prompt", "n_responses", "chosen", "chosen_score", "rejected",
                                         "rejected_score")}, ensure_ascii=False) for r in rows]
    quarantine = pa.table({
        "reason": reasons, "detail": details, "source_file": [r["source_file"] for r in rows],
        "source_line": pa.array([r["source_line"] for r in rows], pa.int64()), "raw": raws,
    }, schema=QUARANTINE_ARROW)
    return pairs, quarantine


def scored_to_pairs(scored_parquet: str, out_dir: str, cfg: IngestConfig | None = None) -> StageReport:
    """scored.parquet (file or folder) -> pairs.parquet + quarantine.parquet (see module doc)."""
    # the pairs' duplicate key is every value of a pair (a scored config's dedupe_key names scored fields)
    cfg = (cfg or IngestConfig()).model_copy(update={"kind": "preference", "dedupe_key": None})
    files = cleaned_files(scored_parquet, cfg.storage_options, stem="scored")
    con = duckdb_for(files, cfg.storage_options)
    sources = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    con.execute(f"CREATE VIEW scored AS SELECT * FROM read_parquet([{sources}])")
    reader = con.sql(PAIRS_SQL).to_arrow_reader(cfg.batch_rows)

    def batches():
        for batch in reader:
            yield _split(pa.Table.from_batches([batch]), cfg.pair_min_margin)

    report = StageReport("scored_to_pairs")
    report = run_contract(batches(), out_dir, cfg, "preference", "pairs.parquet", "scored_to_pairs", report)
    report.extra["inputs"] = files
    report.extra["unit"] = "prompt group"
    return report


def rewards_to_scored(rewards, scored_parquet: str, source: str) -> int:
    """Scored rollouts (the ``rewards`` stage's table) -> a scored log in the scored contract's schema,
    so self-generated samples reach preference pairs through the same path as landed scored logs.
    ``score`` is the mixed ``reward``; ``source_file`` / ``source_line`` point at the rewards artifact."""
    n = len(rewards)
    ids = [f"{p}/{s}" for p, s in zip(rewards["prompt_id"], rewards["sample_index"])]
    categories = [c if isinstance(c, str) else None for c in rewards.get("category", [None] * n)]
    table = pa.table({
        "id": ids, "prompt": rewards["prompt"].astype(str).tolist(), "response": rewards["response"].astype(str).tolist(),
        "score": rewards["reward"].astype(float).tolist(), "category": categories, "source": [source] * n,
        "timestamp": pa.nulls(n, pa.string()), "extra": pa.nulls(n, pa.string()),
        "prompt_messages": pa.nulls(n, pa.string()), "source_file": [source] * n, "source_line": list(range(1, n + 1)),
    }, schema=SCORED_ARROW)
    pq.write_table(table, scored_parquet)
    return n
