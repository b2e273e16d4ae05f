"""The promotion gate (assets/promotion.py): the blocking check `policy_not_regressed` on `evaluation` keeps a
policy that held its held-out accuracy, and withdraws the promotion of one that fell more than
`evaluation.max_regression` below the base model or the previously evaluated policy (promoted_policy goes back to
the better of them). Stand-in base model, checkpoints and evaluation (the real check, storage, catalog, IO
manager and instance): seconds, no model trained."""
import json
import os

import dagster as dg
import pytest

from batchrl.assets.common import declared_files, publish
from batchrl.assets.policy_chain import PROMOTED, promoted_policy
from batchrl.assets.promotion import Baseline, policy_not_regressed, verdict
from batchrl.resources import ArtifactIOManager, CatalogResource, StorageResource
from batchrl.resources.artifacts import latest_ref
from batchrl.resources.storage import ArtifactRef


def _published(context, storage, catalog, name: str, content: dict, inputs: dict | None = None, **kwargs):
    with storage.staging_dir(name) as staging:
        with open(os.path.join(staging, "evaluation.json" if name == "evaluation" else "weights.json"), "w") as f:
            json.dump(content, f)
        return publish(context, storage, catalog, staging, inputs=inputs, **kwargs)


class Scores(dg.Config):
    base: float = 0.1
    policy: float = 0.5
    max_regression: float = 0.05
    prompts: int = 50
    regression_test: str = "point"


def _per_question(accuracy: float, prompts: int) -> list[float]:
    """Scores of ``prompts`` questions at ``accuracy``: the first ones right (two such lists share their answers)."""
    right = round(accuracy * prompts)
    return [1.0] * right + [0.0] * (prompts - right)


@dg.asset
def base_model(context: dg.AssetExecutionContext, storage: StorageResource, catalog: CatalogResource):
    return _published(context, storage, catalog, "base_model", {"weights": "base"})


@dg.asset
def policy_checkpoint(context: dg.AssetExecutionContext, config: Scores, base_model, storage: StorageResource,
                      catalog: CatalogResource):
    """A new checkpoint per run (its content: the score it will get), promoted as the real asset does."""
    output = _published(context, storage, catalog, "policy_checkpoint", {"weights": config.policy},
                        inputs={"reference": base_model, "policy": base_model})
    context.log_event(dg.AssetMaterialization(PROMOTED, metadata={
        "uri": output.value["uri"], "data_version": output.value["data_version"],
        "artifact_asset": "policy_checkpoint"}))
    return output


@dg.asset(metadata=declared_files(results="evaluation.json"))
def evaluation(context: dg.AssetExecutionContext, config: Scores, base_model, policy_checkpoint,
               storage: StorageResource, catalog: CatalogResource):
    gain = config.policy - config.base  # as training.evaluation.paired reports it, an interval of +-0.02 around it
    results = {"base_model": {"arith_accuracy": config.base, "arith_n": config.prompts,
                              "arith_scores": _per_question(config.base, config.prompts)},
               "policy_checkpoint": {"arith_accuracy": config.policy, "arith_n": config.prompts, "arith_gain": gain,
                                     "arith_gain_ci95_low": gain - 0.02, "arith_gain_ci95_high": gain + 0.02,
                                     "arith_scores": _per_question(config.policy, config.prompts)}}
    flat = {f"{model}/arith_accuracy": r["arith_accuracy"] for model, r in results.items()}
    return _published(context, storage, catalog, "evaluation", results, metadata=flat,
                      config={"max_regression": config.max_regression, "regression_test": config.regression_test},
                      inputs={"base_model": base_model, "policy_checkpoint": policy_checkpoint})


@pytest.fixture
def run(tmp_path):
    """``run(policy=..., base=..., max_regression=...)``: materialise the three stand-ins and the check; returns
    (the check's evaluation, the promoted policy's artifact ref, the evaluated checkpoint's data version)."""
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))
    resources = {"storage": storage, "catalog": CatalogResource(path=str(tmp_path / "catalog.duckdb")),
                 "io_manager": ArtifactIOManager(storage=storage)}
    (tmp_path / "home").mkdir()
    instance = dg.DagsterInstance.local_temp(str(tmp_path / "home"))

    def materialise(**scores):
        config = {"ops": {name: {"config": scores} for name in ("policy_checkpoint", "evaluation")}}
        result = dg.materialize([base_model, policy_checkpoint, evaluation, promoted_policy, policy_not_regressed],
                                selection=[base_model, policy_checkpoint, evaluation], instance=instance,
                                resources=resources, run_config=config, raise_on_error=False)
        (check,) = result.get_asset_check_evaluations()
        evaluated = instance.get_latest_materialization_event(dg.AssetKey("policy_checkpoint"))
        return check, latest_ref(instance, dg.AssetKey(PROMOTED)), evaluated.asset_materialization.metadata[
            "data_version"].value

    yield materialise
    instance.dispose()


def test_a_policy_that_learned_stays_promoted(run):
    check, promoted, evaluated = run(base=0.1, policy=0.5)
    assert check.passed and promoted.asset == "policy_checkpoint" and promoted.data_version == evaluated


def test_a_policy_worse_than_the_base_model_is_withdrawn_for_the_base_model(run):
    check, promoted, _ = run(base=0.3, policy=0.2)
    assert not check.passed and promoted.asset == "base_model"
    assert "more than the allowed regression" in check.description
    assert "against base_model, question by question: -0.100 (95% interval -0.120 to -0.080)" in check.description
    assert check.metadata["gain_over_base_ci95_high"].value == pytest.approx(-0.08)


def test_a_policy_worse_than_the_previous_one_is_withdrawn_for_it(run):
    _, first, _ = run(base=0.1, policy=0.6)
    check, promoted, evaluated = run(base=0.1, policy=0.4)
    assert not check.passed and evaluated != first.data_version
    assert (promoted.asset, promoted.data_version) == ("policy_checkpoint", first.data_version)
    assert check.metadata["previous_policy_accuracy"].value == 0.6


def test_a_loss_within_the_margin_is_kept(run):
    check, promoted, evaluated = run(base=0.5, policy=0.46, max_regression=0.05)
    assert check.passed and promoted.data_version == evaluated


def test_a_paired_test_withdraws_only_a_significant_loss(run):
    # 0.30 -> 0.20 on 20 questions: 2 lost, the paired interval reaches above 0: kept, said why
    check, promoted, evaluated = run(base=0.3, policy=0.2, prompts=20, regression_test="paired")
    assert check.passed and promoted.data_version == evaluated
    assert "but not significantly: the paired 95% interval of its gain over base_model is -0.235 to +0.035" in \
        check.description
    # the same loss on 200 questions (20 lost) is significant: withdrawn for the base model
    check, promoted, _ = run(base=0.3, policy=0.2, prompts=200, regression_test="paired")
    assert not check.passed and promoted.asset == "base_model" and ", significantly: " in check.description
    # against the previous policy, from its evaluation's kept scores: 0.6 -> 0.45 on 200 questions
    _, first, _ = run(base=0.1, policy=0.6, prompts=200, regression_test="paired")
    check, promoted, _ = run(base=0.1, policy=0.45, prompts=200, regression_test="paired")
    assert not check.passed and promoted.data_version == first.data_version
    assert "gain over previous policy is" in check.description


def test_a_smoke_size_evaluation_is_not_judged(run):
    check, promoted, evaluated = run(base=0.5, policy=0.25, prompts=4)
    assert check.passed and "not judged" in check.description and promoted.data_version == evaluated


def test_verdict_compares_with_the_best_baseline():
    ref = ArtifactRef("base_model", "file:///b", "b")
    baselines = {"base_model": Baseline(ref, 0.2), "previous policy": Baseline(ref, 0.6)}
    assert verdict(0.56, baselines, 0.05)[0] and not verdict(0.54, baselines, 0.05)[0]
    assert "previous policy 0.600" in verdict(0.54, baselines, 0.05)[1]
    # paired without per-question scores on both sides: the point estimate judges, and says so
    kept, why = verdict(0.54, baselines, 0.05, "paired", [1.0, 0.0])
    assert not kept and "not tested paired: no per-question scores of both on the same questions" in why
