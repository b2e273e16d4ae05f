"""Math verifiers on GSM8K-style solutions and MATH-style boxed LaTeX answers."""
import pytest

from batchrl.training.rewards import math_answers
from batchrl.training.rewards.registry import REWARD_FUNCTIONS, REWARD_NEEDS, RewardConfig, compute_rewards

GSM8K_GOLD = ("Tom buys 3 packs of 12 pencils, so he has 3 * 12 = <<3*12=36>>36 pencils.\n"
              "He gives away 1,200 / 100 = 12 pencils, so 36 - 12 = <<36-12=24>>24 remain.\n#### 24")
GSM8K_GOOD = ("Three packs hold 3 * 12 = 36 pencils. He gives away 12, leaving 36 - 12 = 24.\n#### 24")


def score(name, response, answer):
    return REWARD_FUNCTIONS[name]("question", response, {"answer": answer})


@pytest.mark.parametrize("response,strict,flexible", [
    (GSM8K_GOOD, 1.0, 1.0),
    ("36 - 12 = 24 pencils remain.", 0.0, 1.0),              # right, but not in the #### format
    ("So 24.00 pencils remain", 0.0, 1.0),                     # trailing zeros
    ("#### $24", 1.0, 1.0),                                    # currency sign
    ("#### +24", 1.0, 1.0),
    ("36 - 12 = 24 ... #### 25", 0.0, 0.0),                    # perturbed final answer
    ("#### -24", 0.0, 0.0),                                    # wrong sign
    ("#### 240", 0.0, 0.0),
    ("no number here", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_gsm8k_strict_and_flexible(response, strict, flexible):
    assert score("gsm8k_strict", response, GSM8K_GOLD) == strict
    assert score("gsm8k_flexible", response, GSM8K_GOLD) == flexible


def test_gsm8k_thousands_decimals_and_signs():
    assert score("gsm8k_strict", "#### 1,234,567", "#### 1234567") == 1.0
    assert score("gsm8k_strict", "#### 1234567", "The total is 1,234,567 dollars.\n#### 1,234,567") == 1.0
    assert score("gsm8k_strict", "#### 2.50", "2.5") == 1.0
    assert score("gsm8k_strict", "#### -3", "-3") == 1.0
    assert score("gsm8k_strict", "#### 3", "-3") == 0.0
    assert score("gsm8k_flexible", "It costs 0.75 dollars.", "#### 0.75") == 1.0


@pytest.mark.parametrize("name", ["gsm8k_strict", "gsm8k_flexible", "final_answer"])
@pytest.mark.parametrize("response,gold", [
    ("#### 1000001", "1000000"), ("#### 5000004", "#### 5,000,000"), ("#### 12345678901234567", "12345678901234568"),
    ("#### 0.5000001", "0.5"),
])
def test_large_and_close_wrong_answers_score_zero(name, response, gold):
    assert score(name, response, gold) == 0.0


@pytest.mark.parametrize("name", ["gsm8k_strict", "gsm8k_flexible", "final_answer"])
def test_equal_answers_written_differently_score_one(name):
    assert score(name, "#### 5,000,000.00", "5000000") == 1.0
    assert score(name, "#### 12345678901234567", "#### 12,345,678,901,234,567") == 1.0


def test_only_a_rounded_non_terminating_gold_allows_a_tolerance():
    assert score("gsm8k_flexible", "#### 0.3333333", "0.333333333333") == 1.0  # 1/3 as written by two hands
    assert score("gsm8k_flexible", "#### 0.334", "0.333333333333") == 0.0
    assert score("gsm8k_flexible", "#### 0.3333333", "0.33") == 0.0  # a short decimal is exact


def test_the_first_integer_rule_fails_worked_solutions_where_gsm8k_succeeds():
    wrong_first = "Start with 16 eggs, eat 3, bake 4: 16 - 3 - 4 = 9, sold at 2 dollars: 9 * 2 = 18.\n#### 18"
    assert score("arith_exact", wrong_first, "#### 18") == 0.0
    assert score("gsm8k_strict", wrong_first, "#### 18") == 1.0


@pytest.mark.parametrize("gold,response", [
    ("\\frac{1}{2}", "so the probability is \\boxed{\\dfrac12}."),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
    ("[1, 3)", "The solution set is $\\boxed{[1,3)}$."),
    ("5", "\\boxed{5\\text{ cm}}"),
    ("30", "the angle is \\boxed{30^\\circ}"),
    ("(x+1)^2", "\\boxed{x^2+2x+1}"),
    ("\\frac{\\sqrt{3}}{2}", "first \\boxed{1} then, correcting, \\boxed{\\frac{\\sqrt3}{2}}"),  # last box counts
    ("Solution: ... hence $\\boxed{\\frac{3}{4}}$.", "\\boxed{\\frac{6}{8}}"),  # gold as a full solution
])
def test_math_boxed_equivalence(gold, response):
    assert score("math_strict", response, gold) == 1.0
    assert score("math_flexible", response, gold) == 1.0


@pytest.mark.parametrize("gold,response", [
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{6}}"),
    ("[1, 3)", "\\boxed{(1, 3]}"),
    ("5", "\\boxed{-5}"),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}{2}} but actually \\boxed{1}"),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}"),  # never closed
])
def test_math_perturbed_answers_score_zero(gold, response):
    assert score("math_strict", response, gold) == 0.0
    assert score("math_flexible", response, gold) == 0.0


def test_math_flexible_reads_unboxed_answers_strict_does_not():
    for response in ("<answer>1/2</answer>", "so x = \\frac{1}{2}"):
        assert score("math_strict", response, "\\frac12") == 0.0
        assert score("math_flexible", response, "\\frac12") == 1.0


def test_last_boxed_handles_nesting_and_braceless():
    assert math_answers.last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert math_answers.last_boxed("\\boxed 7.") == "7"
    assert math_answers.last_boxed("\\fbox{x}") == "x"
    assert math_answers.last_boxed("nothing") is None


def test_format_rewards():
    fmt = lambda name, r: REWARD_FUNCTIONS[name]("q", r, {})  # noqa: E731
    assert fmt("format_boxed", "x \\boxed{3}") == 1.0
    assert fmt("format_boxed", "x \\boxed{}") == 0.0
    assert fmt("format_answer_tag", "<think>..</think><answer>3</answer>") == 1.0
    assert fmt("format_answer_tag", "<answer>3</answer><answer>4</answer>") == 0.0
    assert fmt("format_final_mark", "so #### 3") == 1.0
    assert fmt("format_final_mark", "so 3") == 0.0


def test_fallback_without_math_verify(monkeypatch):
    """Documented fallback: string/rational equality; it never credits a wrong answer."""
    monkeypatch.setattr(math_answers, "math_verify", None)
    assert score("math_strict", "\\boxed{\\dfrac{1}{2}}", "\\frac12") == 1.0
    assert score("math_strict", "\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert score("math_strict", "\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert score("math_strict", "\\boxed{5\\text{ cm}}", "5") == 1.0
    assert score("math_strict", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == 0.0
    assert score("math_flexible", "the answer is 12", "12") == 1.0


def test_registered_with_needs_and_mixed_by_config():
    assert REWARD_NEEDS["math_strict"] == ("answer",) and REWARD_NEEDS["format_boxed"] == ()
    rows = [{"prompt": "p", "response": "\\boxed{2}", "answer": "2", "category": "math"},
            {"prompt": "p", "response": "#### 7", "answer": "#### 7", "category": "gsm8k"}]
    cfg = RewardConfig(rule="math_strict", custom={"gsm": "gsm8k_strict", "fmt": "format_boxed"},
                       weights={"rule": 1.0}, routing={"gsm8k": {"gsm": 1.0}, "math": {"rule": 0.9, "fmt": 0.1}})
    out = compute_rewards(rows, cfg)
    assert out["reward"].tolist() == pytest.approx([1.0, 1.0])
    assert out["rule"].tolist() == [1.0, 0.0] and out["gsm"].tolist() == [0.0, 1.0]
