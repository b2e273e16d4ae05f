import json
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from batchrl.training.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardConfig,
    compute_rewards,
    first_integer,
    get_reward_function,
    mix_rewards,
)

ARITH = Path(__file__).resolve().parents[1] / "sample_data" / "arith"


def test_first_integer():
    assert first_integer("It is 12, not 3") == 12
    assert first_integer("-4") == -4
    assert first_integer("no digits") is None


@pytest.mark.parametrize(
    "response,exact,partial",
    [("7", 1.0, 1.0), (" 7.", 1.0, 1.0), ("It is 7", 1.0, 1.0), ("17", 0.0, 0.2), ("3 then 7", 0.0, 0.2), ("seven", 0.0, 0.0), ("", 0.0, 0.0)],
)
def test_arith_rules(response, exact, partial):
    meta = {"answer": "7"}
    assert REWARD_FUNCTIONS["arith_exact"]("What is 3 + 4?", response, meta) == exact
    assert REWARD_FUNCTIONS["arith_partial"]("What is 3 + 4?", response, meta) == pytest.approx(partial)


def test_arith_rules_without_answer_give_zero():
    for meta in ({}, {"answer": None}, {"answer": float("nan")}):
        assert REWARD_FUNCTIONS["arith_exact"]("hi", "7", meta) == 0.0
        assert REWARD_FUNCTIONS["arith_partial"]("hi", "7", meta) == 0.0


def test_length_penalty():
    fn = REWARD_FUNCTIONS["length_penalty"]
    assert fn("p", "x" * 32, {}) == 0.0
    assert fn("p", "x" * 48, {}) == pytest.approx(-0.5)
    assert fn("p", "x" * 500, {}) == -1.0
    assert fn("p", "x" * 15, {"length_budget": 10}) == pytest.approx(-0.5)


def test_custom_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def shout(prompt, response, meta):
                return 1.0 if response.isupper() else -1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_function("my_rewards:shout")
    assert fn("p", "YES", {}) == 1.0 and fn("p", "no", {}) == -1.0
    out = compute_rewards(
        [{"prompt": "p", "response": "YES", "answer": "1"}, {"prompt": "p", "response": "1", "answer": "1"}],
        RewardConfig(rule="arith_exact", custom={"shout": "my_rewards:shout"}, weights={"rule": 1.0, "shout": 0.5}),
    )
    assert out["shout"].tolist() == [1.0, -1.0]
    assert out["reward"].tolist() == [0.5, 0.5]
    with pytest.raises(KeyError):
        get_reward_function("no_such_reward")
    with pytest.raises(ModuleNotFoundError):
        get_reward_function("no_such_module_xyz:fn")


def test_mix_rewards_with_routing():
    components = {"rule": np.array([1.0, 0.0, 1.0]), "reward_model": np.array([0.5, 2.0, -1.0])}
    weights = {"rule": 1.0, "reward_model": 0.1}
    np.testing.assert_allclose(mix_rewards(components, weights), [1.05, 0.2, 0.9])
    routing = {"arith": {"rule": 1.0}, "chat": {"reward_model": 1.0}}
    mixed = mix_rewards(components, weights, category=["arith", "chat", "other"], routing=routing)
    np.testing.assert_allclose(mixed, [1.0, 2.0, 0.9])  # "other" falls back to the default weights
    np.testing.assert_allclose(mix_rewards(components, weights, category="chat", routing=routing), [0.5, 2.0, -1.0])
    with pytest.raises(KeyError, match="not computed"):
        mix_rewards(components, {"rule": 1.0, "length": 0.3})
    with pytest.raises(ValueError):
        mix_rewards(components, weights, category=["arith"], routing=routing)


def test_compute_rewards_on_arith_rows():
    rows = [json.loads(line) for line in (ARITH / "eval.jsonl").read_text().splitlines()][:4]
    frame = pd.DataFrame(rows)
    frame["response"] = [rows[0]["answer"], "99", "no idea", f"It is {rows[3]['answer']}"]
    out = compute_rewards(frame, RewardConfig(custom={"length": "length_penalty"}, weights={"rule": 1.0, "length": 1.0}))
    assert out["rule"].tolist() == pytest.approx([1.0, 0.2, 0.0, 1.0])
    assert out["length"].tolist() == [0.0] * 4
    assert out["reward"].tolist() == pytest.approx([1.0, 0.2, 0.0, 1.0])
    assert list(out["id"]) == [r["id"] for r in rows]  # input columns kept, order kept
    assert "reward_model" not in out
    with pytest.raises(ValueError, match="reward_model_path"):
        compute_rewards(frame, RewardConfig(weights={"rule": 1.0, "reward_model": 0.5}))


def test_unfinished_trajectories_get_the_configured_reward_whatever_their_answer():
    """The tool task on the H200: a trained policy echoed its result in tool calls until the turn budget (65% of
    held-out trajectories ended at max_turns) and was paid for the number in its last turn. ``unfinished_reward``
    pays a trajectory that did not end on its own that reward; stop-finished ones and single-turn rows keep theirs."""
    rows = [{"prompt": "What is 12 * 34?", "response": r, "answer": "408", "finish_reason": f}
            for r, f in (("408", "stop"), ("```python\n408\n```", "max_turns"), ("The answer is 408", "length"),
                         ("407", "stop"))]
    cfg = RewardConfig(rule="final_answer")
    assert compute_rewards(rows, cfg)["reward"].tolist() == [1.0, 1.0, 1.0, 0.0]
    gated = RewardConfig(rule="final_answer", unfinished_reward=-0.5)
    assert compute_rewards(rows, gated)["reward"].tolist() == [1.0, -0.5, -0.5, 0.0]
    one_turn = [{k: v for k, v in r.items() if k != "finish_reason"} for r in rows]
    assert compute_rewards(one_turn, gated)["reward"].tolist() == [1.0, 1.0, 1.0, 0.0]
