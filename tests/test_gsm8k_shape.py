"""GSM8K by config alone (issue 48): the original jsonl(.gz) as a prompt set, gold after ``####``, rows without
it quarantined with a reason, the benchmark's answer reading (``####``, ``\\boxed{}``, last number), and the
answer statistics evaluation reports (truncation, loops, format)."""
from __future__ import annotations

import gzip
import json
import os

import dagster as dg
import pandas as pd
import pytest
from pipeline_helpers import latest_metadata, local_resources, run_assets

import batchrl.training.rewards.math_answers  # noqa: F401  (registers the math rewards)
from batchrl.resources import LandingResource
from batchrl.training.evaluation.answer_stats import answer_stats, repeats_itself
from batchrl.training.data.prompt_shapes import VERL_GSM8K_SUFFIX, PromptQuarantine
from batchrl.training.data.prompts import PromptFileError, load_prompts
from batchrl.training.rewards.registry import REWARD_FUNCTIONS

SHARED_GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "test.jsonl.gz")
ROWS = [{"question": "Janet has 3 eggs and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A shop sells 1,000 pens at $2. Revenue?", "answer": "1000 * 2 = 2000\n#### 2,000"},
        {"question": "No gold here?", "answer": "the answer is 5"},
        {"question": "Negative?", "answer": "#### -3"}]


def _gz(path, rows):
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_gsm8k_shape_reads_gold_and_quarantines_rows_without_it(tmp_path):
    quarantine = PromptQuarantine()
    table = load_prompts(_gz(tmp_path / "train.jsonl.gz", ROWS), shape="gsm8k", quarantine=quarantine)
    assert table["answer"].tolist() == ["7", "2000", "-3"]
    assert table["prompt"].iloc[0] == ROWS[0]["question"] + VERL_GSM8K_SUFFIX
    assert set(table["category"]) == {"gsm8k"}
    assert quarantine.reasons() == {"missing_gold_answer": 1}
    (row,) = quarantine.rows
    assert row["where"].endswith("train.jsonl.gz:3") and json.loads(row["raw"]) == ROWS[2]
    custom = load_prompts(_gz(tmp_path / "t2.jsonl.gz", ROWS[:1]), shape="gsm8k", suffix=" Answer:")
    assert custom["prompt"].iloc[0].endswith("How many? Answer:")


def test_without_a_quarantine_the_row_fails_the_load_naming_file_and_line(tmp_path):
    with pytest.raises(PromptFileError, match=r"bad.jsonl.gz:3: missing_gold_answer"):
        load_prompts(_gz(tmp_path / "bad.jsonl.gz", ROWS), shape="gsm8k")


@pytest.mark.skipif(not os.path.exists(SHARED_GSM8K), reason="the team's shared GSM8K copy is not beside the checkout")
def test_the_real_test_split_loads_whole():
    table = load_prompts(SHARED_GSM8K, shape="gsm8k", quarantine=PromptQuarantine())
    assert len(table) == 1319 and table["answer"].str.fullmatch(r"-?\d+(\.\d+)?").all()


@pytest.mark.parametrize("response,score", [
    ("She makes 9 * 2 = 18 dollars.\n#### 18", 1.0), ("so the answer is \\boxed{18}.", 1.0),
    ("\\boxed{\\$18}", 1.0), ("She makes 18 dollars.", 1.0), ("#### 18.0", 1.0), ("#### 19 ... 18", 0.0),
    ("\\boxed{17} but maybe 18", 0.0), ("", 0.0)])
def test_gsm8k_reward_reads_marks_boxes_then_the_last_number(response, score):
    assert REWARD_FUNCTIONS["gsm8k"]("", response, {"answer": "9 * 2 = 18\n#### 18"}) == score


def test_format_gsm8k():
    fmt = REWARD_FUNCTIONS["format_gsm8k"]
    assert fmt("", "#### 5", {}) == 1.0 and fmt("", "\\boxed{5}", {}) == 1.0
    assert fmt("", "it is 5", {}) == 0.0 and fmt("", "\\boxed{x}", {}) == 0.0


def test_answer_stats_truncation_loops_and_length():
    loop = list(range(20)) * 3
    samples = [{"finish_reason": "length", "response_ids": loop}, {"finish_reason": "stop", "response_ids": [1, 2, 3]}]
    assert repeats_itself(loop) and not repeats_itself(list(range(100))) and not repeats_itself(list(range(20)) * 2)
    assert answer_stats(samples) == {"truncation_rate": 0.5, "loop_rate": 0.5, "mean_answer_tokens": 31.5}


def test_prompts_asset_publishes_the_quarantine(tmp_path):
    landing = LandingResource(prompts=_gz(tmp_path / "train.jsonl.gz", ROWS))
    run_config = {"ops": {"prompts": {"config": {"shape": "gsm8k", "prompt_suffix": " Think."}}}}
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_assets(local_resources(str(tmp_path / "s"), landing), instance, ["prompts"], run_config).success
        meta = latest_metadata(instance, "prompts")
        assert (meta["rows_in"], meta["rows"], meta["quarantined"]) == (4, 3, 1)
        assert meta["reasons"] == {"missing_gold_answer": 1}
    quarantined = pd.read_parquet(os.path.join(meta["uri"], "quarantine.parquet"))
    assert quarantined["reason"].tolist() == ["missing_gold_answer"] and "No gold here?" in quarantined["raw"].iloc[0]


def _answer_kinds_module():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "answer_kinds.py")
    spec = importlib.util.spec_from_file_location("answer_kinds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answer_kinds_pair_each_question_before_and_after():
    """bench/answer_kinds.py --against: where a policy's gain came from, question by question (RESULTS' table of the
    1.5B's answers rests on it)."""
    kinds = _answer_kinds_module()
    program = "```python\nprint(3 + 4)\n```\n```output\n7\n```\n#### {}"
    before = [{"prompt": "q1", "answer": "7", "response": program.format(8)},   # program+output, wrong
              {"prompt": "q2", "answer": "7", "response": program.format(7)},   # program+output, right
              {"prompt": "q3", "answer": "5", "response": "2 + 3 = 5\n#### 5"}]  # text, right
    after = [{"prompt": "q1", "answer": "7", "response": "3 + 4 = 7\n#### 7"},   # left the program: now right
             {"prompt": "q2", "answer": "7", "response": program.format(7)},
             {"prompt": "q3", "answer": "5", "response": "2 + 3 = 6\n#### 6"}]  # text, now wrong
    reward = REWARD_FUNCTIONS["gsm8k"]
    table = kinds.kind_transitions(before, after, reward)
    assert table == {"program+output -> text": {"n": 1, "right_before": 0, "right_after": 1},
                     "program+output -> program+output": {"n": 1, "right_before": 1, "right_after": 1},
                     "text -> text": {"n": 1, "right_before": 1, "right_after": 0}}
    assert kinds.kinds_of(after, reward)["text"] == {"share": 2 / 3, "accuracy": 0.5, "n": 2}
    with pytest.raises(ValueError, match="not paired"):
        kinds.kind_transitions(before, after[::-1], reward)
