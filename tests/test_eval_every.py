"""Held-out accuracy against the RL iteration (issue 48): `batchrl run --rl-iterations N --eval-every K` evaluates
after every K-th iteration and after the last; each evaluation carries its policy's chain and iteration, and the
chain's iteration chart draws its accuracy, format, truncation and loop rates and answer length there (the base
model's at iteration 0). The chart is read from a real Dagster instance's materialisations."""
from __future__ import annotations

import argparse

import dagster as dg
import pytest

from batchrl.assets.iteration_chart import (
    CHARTED, EVALUATED_BASE, chain_chart_metadata, chain_history, iteration_panels,
)
from batchrl.assets.policy_chain import CHAIN, ITERATION
from batchrl.cli.run_command import EVALUATION_AFTER, RL_LOOP, _plan, add_command, announced_next, evaluation_skipped

CHAIN_A, CHAIN_B = "base_model@aaaa", "base_model@bbbb"


@pytest.fixture(scope="module")
def defs(tmp_path_factory):
    from pipeline_helpers import local_resources

    from batchrl.definitions import build_definitions

    return build_definitions(local_resources(str(tmp_path_factory.mktemp("eval_every") / "s")))


def _titles(plan) -> list[str]:
    return [title for title, _, _ in plan]


def test_evaluation_runs_after_every_kth_iteration_and_after_the_last(defs):
    every = argparse.Namespace(select="*")
    plan = _plan(defs, every, {}, 5, eval_every=2)
    assert _titles(plan) == ["", "RL iteration 2 of 5", f"{EVALUATION_AFTER} 2", "RL iteration 3 of 5",
                             "RL iteration 4 of 5", f"{EVALUATION_AFTER} 4", "RL iteration 5 of 5", "evaluation"]
    assert "evaluation" not in plan[0][1] and all(sel == ["evaluation"] for t, sel, _ in plan if "evaluation" in t)
    assert _titles(_plan(defs, every, {}, 4, eval_every=2))[-2:] == ["RL iteration 4 of 4", "evaluation"]  # once
    # off, today's behaviour: evaluation once, after the last iteration
    assert _titles(_plan(defs, every, {}, 3)) == ["", "RL iteration 2 of 3", "RL iteration 3 of 3", "evaluation"]
    # a selection without evaluation evaluates nowhere
    rl_only = _plan(defs, argparse.Namespace(select=",".join(RL_LOOP)), {}, 3, eval_every=1)
    assert not any("evaluation" in title for title in _titles(rl_only))


def test_an_evaluation_between_iterations_still_announces_the_next_iterations_seed(defs):
    plan = _plan(defs, argparse.Namespace(select="*"), {}, 4, eval_every=2)
    seeds = [announced_next(plan, position).get("batchrl/next_rollouts_seed") for position in range(len(plan))]
    # "", RL 2, eval after 2, RL 3, RL 4, evaluation: RL 2's update samples ahead for RL 3 past the evaluation
    assert seeds == ["1", "2", "2", "3", None, None]


def test_skipped_evaluations_with_a_time_budget_or_nothing_new_to_evaluate():
    assert not evaluation_skipped("RL iteration 3 of 5", evaluated_since=True, budget_spent=True)
    assert not evaluation_skipped(f"{EVALUATION_AFTER} 2", evaluated_since=False, budget_spent=False)
    assert evaluation_skipped(f"{EVALUATION_AFTER} 4", evaluated_since=False, budget_spent=True)  # iterations skipped
    assert not evaluation_skipped("evaluation", evaluated_since=False, budget_spent=True)  # the last one still runs
    assert evaluation_skipped("evaluation", evaluated_since=True, budget_spent=True)  # that policy is evaluated


def test_eval_every_is_a_whole_number_of_iterations(capsys):
    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    assert parser.parse_args(["run", "--rl-iterations", "8", "--eval-every", "2"]).eval_every == 2
    assert parser.parse_args(["run"]).eval_every is None
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--eval-every", "0"])
    assert "'0': a whole number of RL iterations, at least 1" in capsys.readouterr().err


def _evaluation(iteration: int, accuracy: float, chain: str = CHAIN_A, base: str | None = CHAIN_A) -> dict:
    """An evaluation's metadata as the asset publishes it: per model its numbers, the policy's chain position."""
    policy = {"arith_accuracy": accuracy, "format_rate": accuracy + 0.1, "truncation_rate": 0.5 - accuracy / 2,
              "loop_rate": 0.2, "mean_answer_tokens": 300.0 - 100 * accuracy, "arith_n": 1319,
              "arith_gain": accuracy - 0.27, "arith_gain_ci95_low": accuracy - 0.29,
              "arith_gain_ci95_high": accuracy - 0.25}
    metadata = {f"policy_checkpoint/{k}": v for k, v in policy.items()}
    metadata.update({"base_model/arith_accuracy": 0.27, "base_model/format_rate": 0.6, "dpo_checkpoint/arith_accuracy":
                     0.9, ITERATION: iteration, CHAIN: chain})
    return {**metadata, **({EVALUATED_BASE: base} if base else {})}


@pytest.fixture()
def instance():
    with dg.DagsterInstance.ephemeral() as instance:
        def record(asset: str, metadata: dict) -> None:
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, metadata=metadata))

        for i in range(1, 5):
            record("rewards", {"mean_reward": 0.1 * i, ITERATION: i, CHAIN: CHAIN_A})
        record("evaluation", _evaluation(2, 0.30))
        record("evaluation", _evaluation(4, 0.31))
        record("evaluation", _evaluation(4, 0.35))  # iteration 4 evaluated again: its newest numbers count
        record("evaluation", _evaluation(3, 0.99, chain=CHAIN_B, base=CHAIN_B))  # another chain: not mixed in
        record("evaluation", {"policy_checkpoint/arith_accuracy": 0.5})  # a policy of no known iteration
        yield instance


def test_the_iteration_chart_draws_each_evaluation_at_its_policys_iteration(instance):
    history = chain_history(instance, CHAIN_A, CHARTED)
    assert sorted(history["evaluation"]) == [0, 2, 4] and sorted(history["rewards"]) == [1, 2, 3, 4]
    assert history["evaluation"][4]["arith_accuracy"] == 0.35 and history["evaluation"][0]["arith_accuracy"] == 0.27
    assert "dpo_checkpoint/arith_accuracy" not in history["evaluation"][2]  # the policy's numbers, by metric name
    panels = iteration_panels(history)
    assert panels["held-out accuracy"]["arith_accuracy"] == ([0, 2, 4], [0.27, 0.30, 0.35])
    assert panels["held-out accuracy"]["format_rate"] == ([0, 2, 4], pytest.approx([0.6, 0.4, 0.45]))
    assert panels["held-out truncation, loops"]["loop_rate"] == ([2, 4], [0.2, 0.2])  # the base model's not recorded
    assert panels["held-out answer tokens"]["mean_answer_tokens"] == ([2, 4], [270.0, 265.0])
    gain = panels["held-out gain over base (95%)"]  # from the first evaluated policy: the base has no gain over itself
    assert gain["arith_gain"] == ([2, 4], pytest.approx([0.03, 0.08]))
    assert gain["arith_gain_ci95_low"] == ([2, 4], pytest.approx([0.01, 0.06]))
    assert panels["reward"]["mean_reward"][0] == [1, 2, 3, 4]


def test_a_base_model_of_another_chain_is_not_drawn_at_iteration_zero(instance):
    instance.report_runless_asset_event(dg.AssetMaterialization("evaluation", metadata=_evaluation(
        5, 0.4, base="base_model@newer")))  # the base model rebuilt since the chain began
    history = chain_history(instance, CHAIN_A, CHARTED)["evaluation"]
    assert sorted(history) == [0, 2, 4, 5] and history[0]["arith_accuracy"] == 0.27  # the older, right base's


def test_an_evaluation_draws_the_chain_with_its_own_numbers(instance, monkeypatch):
    """The evaluation after the last iteration is in no promotion's chart: it draws the chain itself, its own
    numbers (not in the instance yet) at its iteration."""
    from batchrl.assets import iteration_chart

    drawn_panels = []
    draw = iteration_chart.line_panels
    monkeypatch.setattr(iteration_chart, "line_panels", lambda panels, **kw: drawn_panels.append(panels) or draw(
        panels, **kw))
    drawn = chain_chart_metadata(instance, CHAIN_A, 6, {"evaluation": _evaluation(6, 0.42)})
    assert drawn["iterations_chart"].value.startswith("![the RL chain per iteration](data:image/png;base64,")
    assert drawn_panels[0]["held-out accuracy"]["arith_accuracy"] == ([0, 2, 4, 6], [0.27, 0.30, 0.35, 0.42])
    assert chain_chart_metadata(instance, "base_model@none", 1, {}) == {}
