"""The uncertainty of a held-out accuracy and of a gain over a baseline on the same questions
(training/evaluation/paired.py): numbers worked by hand."""
import math

import pytest

from batchrl.training.evaluation.paired import Z95, mean_stderr, paired_gain


def test_the_standard_error_of_an_accuracy():
    assert mean_stderr([1, 0, 1, 0]) == pytest.approx(math.sqrt(1 / 3) / 2)  # s = sqrt(1/3) (ddof 1), n = 4
    assert mean_stderr([1, 1, 1]) == 0.0 and mean_stderr([1]) == 0.0 and mean_stderr([]) == 0.0


def test_a_paired_gain_counts_questions_won_and_lost_and_cancels_shared_answers():
    base = [1, 1, 0, 0, 1, 0, 1, 0]
    model = [1, 1, 1, 0, 1, 1, 0, 0]  # won questions 2 and 5, lost question 6
    gain = paired_gain(model, base)
    diffs = [0, 0, 1, 0, 0, 1, -1, 0]
    mean = sum(diffs) / 8
    stderr = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 7) / math.sqrt(8)
    assert gain["arith_gain"] == pytest.approx(0.125) and gain["arith_gain_stderr"] == pytest.approx(stderr)
    assert gain["arith_gain_ci95_low"] == pytest.approx(0.125 - Z95 * stderr)
    assert gain["arith_gain_ci95_high"] == pytest.approx(0.125 + Z95 * stderr)
    assert (gain["arith_gain_questions_won"], gain["arith_gain_questions_lost"]) == (2, 1)
    # the paired error is below the two accuracies' errors combined: the questions both answer alike cancel
    assert gain["arith_gain_stderr"] < math.hypot(mean_stderr(model), mean_stderr(base))
    assert paired_gain(base, base, prefix="g") == {"g": 0.0, "g_stderr": 0.0, "g_ci95_low": 0.0, "g_ci95_high": 0.0,
                                                   "g_questions_won": 0, "g_questions_lost": 0}


def test_a_paired_gain_needs_the_same_questions():
    with pytest.raises(ValueError, match="3 scores against 2 baseline scores"):
        paired_gain([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="at least one"):
        paired_gain([], [])
