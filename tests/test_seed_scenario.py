"""The seeds' customer-service scenario (shared/seeds/001, §3) done with batchrl's own pieces:

an Arrow file with ``prompt/response/rating(1-5)/category`` is ingested with a field mapping
(``rating -> score``), DPO pairs are built from the ratings, and rewards are routed by category to
different reward functions (complaints: a strict rule; after-sales: a template check; consultations
and anything unrouted: the default route) — configuration, no new training code.
"""
import pandas as pd
import pyarrow as pa
import pytest

from batchrl.ingest import IngestConfig, clean_logs, discover_inputs, scored_to_pairs, validate_scored
from batchrl.training.rewards.registry import RewardConfig, compute_rewards

ROWS = [
    ("My parcel never arrived and nobody answers.", "We are sorry. Refund issued, order #123.", 5, "complaint"),
    ("My parcel never arrived and nobody answers.", "Please wait.", 1, "complaint"),
    ("Does this phone support 5G?", "Yes, it supports 5G on all bands.", 4, "consult"),
    ("Does this phone support 5G?", "I don't know.", 2, "consult"),
    ("How do I return a broken kettle?", "Step 1: open Orders. Step 2: choose Return.", 5, "after_sales"),
    ("How do I return a broken kettle?", "Just send it back.", 2, "after_sales"),
]


def strict_apology(prompt, response, meta):
    """Complaints: full marks only for an apology that states a concrete remedy."""
    text = response.lower()
    return float("sorry" in text and ("refund" in text or "replacement" in text))


def follows_template(prompt, response, meta):
    """After-sales: numbered steps."""
    return float("step 1" in response.lower())


def answers_yes_no(prompt, response, meta):
    """Consultations (the default route): a direct answer."""
    return float(response.lower().startswith(("yes", "no")))


@pytest.fixture
def arrow_file(tmp_path):
    table = pa.table({"prompt": [r[0] for r in ROWS], "response": [r[1] for r in ROWS],
                      "rating": pa.array([r[2] for r in ROWS], pa.int8()), "category": [r[3] for r in ROWS]})
    path = tmp_path / "landing" / "service.arrow"
    path.parent.mkdir()
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


def test_arrow_ratings_become_validated_logs_and_dpo_pairs(arrow_file, tmp_path):
    cfg = IngestConfig(kind="scored", field_mapping={"rating": "score"})
    clean_logs(discover_inputs(str(arrow_file.parent)), str(tmp_path / "cleaned"), cfg)
    report = validate_scored(str(tmp_path / "cleaned"), str(tmp_path / "scored"), cfg)
    assert report.valid == len(ROWS) and report.quarantined == 0
    scored = pd.read_parquet(tmp_path / "scored" / "scored.parquet")
    assert sorted(scored["score"]) == sorted(float(r[2]) for r in ROWS)
    assert set(scored["category"]) == {"complaint", "consult", "after_sales"}
    scored_to_pairs(str(tmp_path / "scored" / "scored.parquet"), str(tmp_path / "pairs"), cfg)
    pairs = pd.read_parquet(tmp_path / "pairs" / "pairs.parquet")
    assert len(pairs) == 3  # one best-vs-worst pair per question
    for _, pair in pairs.iterrows():  # the higher-rated reply is always the chosen one
        rating = {r[1]: r[2] for r in ROWS}
        assert rating[pair["chosen"]] > rating[pair["rejected"]]


def test_rewards_route_by_category_with_a_default(monkeypatch):
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    module = "test_seed_scenario"
    cfg = RewardConfig(rule=f"{module}:answers_yes_no",
                       custom={"strict": f"{module}:strict_apology", "template": f"{module}:follows_template"},
                       weights={"rule": 1.0},  # consult and anything unrouted
                       routing={"complaint": {"strict": 1.0}, "after_sales": {"template": 1.0}})
    rows = [{"prompt": p, "response": r, "category": c} for p, r, _, c in ROWS]
    rows.append({"prompt": "Hello?", "response": "Yes, how can I help?", "category": "smalltalk"})
    out = compute_rewards(rows, cfg)
    assert out["reward"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # each route really used its own function: the strict rule would give the consult "Yes" reply 0
    assert out.loc[2, "strict"] == 0.0 and out.loc[2, "reward"] == 1.0
