"""The promotion gate: a policy that got worse on the held-out split does not stay the promoted policy.

``policy_checkpoint`` promotes each new checkpoint at once (``promoted_policy`` is the RL loop's back edge: the
next iteration samples from it, and held-out evaluation runs once, after the last iteration). The blocking check
``policy_not_regressed`` on ``evaluation`` then compares the evaluated policy's held-out accuracy with its
baselines: the base model's in the same evaluation, and the policy of the previous evaluation on the same base
model and held-out file (the one before it, kept or not: a withdrawn one scored below the base), on at least
``MIN_PROMPTS`` held-out prompts. When the policy falls more than ``evaluation.max_regression`` below the better
baseline, the check fails (the run fails, the UI shows why) and the promotion is withdrawn: ``promoted_policy`` is
materialised again as that baseline, so the next iteration or nightly retrain starts from it, not from the
regressed checkpoint. The check shows beside its verdict the policy's paired gain over the base model with its 95%
interval (``training.evaluation.paired``); ``evaluation.regression_test: paired`` withdraws only a significant loss
(``verdict``).
"""

import json
from dataclasses import dataclass

import dagster as dg

from batchrl.assets.evaluation import RESULTS_FILE
from batchrl.assets.policy_chain import PROMOTED, repromote
from batchrl.resources import Artifact, StorageResource
from batchrl.resources.artifacts import make_local
from batchrl.resources.storage import ArtifactRef
from batchrl.training.evaluation.paired import SCORES, paired_gain

METRIC = "arith_accuracy"  # the held-out accuracy evaluation reports for every model (greedy, the task's reward)
# fewer held-out prompts than this (the CPU smoke size of the profiles: 4-8) and one answer moves the accuracy by
# more than any margin: the check then passes, saying it did not judge
MIN_PROMPTS = 20
POLICY, BASE = "policy_checkpoint", "base_model"


@dataclass(frozen=True)
class Baseline:
    """A model the policy must not fall behind: its artifact and its held-out accuracy."""

    ref: ArtifactRef
    accuracy: float
    scores: list[float] | None = None  # per held-out question, where its evaluation kept them (a paired test)


def previous_policy(instance: dg.DagsterInstance, storage: StorageResource, current: Artifact) -> Baseline | None:
    """The policy the evaluation before ``current`` scored, when it ran on the same base model and held-out file
    (None for the first evaluation, or when the base model or the prompts changed: no like-for-like number)."""
    records = instance.fetch_materializations(dg.AssetKey("evaluation"), limit=2).records
    metadata = records[1].asset_materialization.metadata if len(records) > 1 else {}
    if f"{POLICY}/{METRIC}" not in metadata or "uri" not in metadata:
        return None
    try:
        earlier = make_local(storage, ArtifactRef("evaluation", metadata["uri"].value, metadata["data_version"].value),
                             files={"results": RESULTS_FILE})
    except OSError:  # its files gone (a root cleaned by hand): no like-for-like number, the base model still judges
        return None
    if earlier.data_version == current.data_version or _basis(earlier) != _basis(current):
        return None
    with open(earlier.file("results")) as f:
        scores = json.load(f).get(POLICY, {}).get(SCORES)
    return Baseline(earlier.input_ref(POLICY), float(metadata[f"{POLICY}/{METRIC}"].value), scores)


def _basis(evaluation: Artifact) -> tuple:
    """What makes two evaluations' accuracies comparable: the base model and the held-out file's content."""
    base = evaluation.input_ref(BASE)
    return (base.data_version if base else None, tuple(f["sha256"] for f in evaluation.lineage.get("input_files", [])))


def verdict(accuracy: float, baselines: dict[str, Baseline], max_regression: float, test: str = "point",
            scores: list[float] | None = None) -> tuple[bool, str]:
    """(kept, why): the policy is kept unless its accuracy is below the best baseline's by more than
    ``max_regression`` (a fraction: 0.05 = 5 points). ``test`` paired: such a policy is still kept when its loss
    is not significant, question by question against that baseline (``scores``, the policy's per-question scores:
    the 95% interval of its paired gain reaches 0); where either side has no per-question scores, or not on the
    same questions, the point estimate judges, said."""
    name, best = max(baselines.items(), key=lambda item: item[1].accuracy)
    kept = accuracy >= best.accuracy - max_regression
    relation = "within" if kept else "more than"
    why = f"held-out {METRIC} {accuracy:.3f} vs {name} {best.accuracy:.3f}: {relation} the allowed regression of " \
          f"{max_regression:.3f}"
    if kept or test != "paired":
        return kept, why
    if scores is None or best.scores is None or len(scores) != len(best.scores):
        return kept, why + f"; not tested paired: no per-question scores of both on the same questions ({name})"
    gain = paired_gain(scores, best.scores, prefix="gain")
    interval = f"{gain['gain_ci95_low']:+.3f} to {gain['gain_ci95_high']:+.3f}"
    if gain["gain_ci95_high"] >= 0:
        return True, why + f", but not significantly: the paired 95% interval of its gain over {name} is {interval}"
    return False, why + f", significantly: the paired 95% interval of its gain over {name} is {interval}"


@dg.asset_check(asset="evaluation", blocking=True,
                description="Blocks promotion of a policy that got worse: fails, and puts promoted_policy back to the "
                            "better of the base model and the previously evaluated policy, when the evaluated "
                            "policy's held-out accuracy falls more than evaluation.max_regression below it.")
def policy_not_regressed(context: dg.AssetCheckExecutionContext, evaluation: Artifact,
                         storage: StorageResource) -> dg.AssetCheckResult:
    with open(evaluation.file("results")) as f:
        results = json.load(f)
    baselines = {BASE: Baseline(evaluation.input_ref(BASE), float(results[BASE][METRIC]), results[BASE].get(SCORES))}
    previous = previous_policy(context.instance, storage, evaluation)
    if previous is not None:
        baselines["previous policy"] = previous
    accuracy, prompts = float(results[POLICY][METRIC]), int(results[POLICY].get("arith_n", 0))
    if prompts < MIN_PROMPTS:
        why = f"{prompts} held-out prompts, fewer than {MIN_PROMPTS}: too few to judge a regression, not judged"
        return dg.AssetCheckResult(passed=True, metadata={"policy_accuracy": accuracy, "why": why}, description=why)
    config = evaluation.lineage.get("config", {})
    max_regression = float(config.get("max_regression", 0.0))
    kept, why = verdict(accuracy, baselines, max_regression, config.get("regression_test", "point"),
                        results[POLICY].get(SCORES))
    paired = {key.replace("arith_gain", "gain_over_base"): value for key, value in results[POLICY].items()
              if key in ("arith_gain", "arith_gain_ci95_low", "arith_gain_ci95_high")}  # training.evaluation.paired
    if len(paired) == 3:  # how sure the policy's gain over the base is, shown beside the verdict whatever the test
        why += (f"; against {BASE}, question by question: {paired['gain_over_base']:+.3f} (95% interval "
                f"{paired['gain_over_base_ci95_low']:+.3f} to {paired['gain_over_base_ci95_high']:+.3f})")
    metadata = {"policy_accuracy": accuracy, "max_regression": max_regression, "why": why, **paired,
                **{f"{name}_accuracy".replace(" ", "_"): b.accuracy for name, b in baselines.items()}}
    if not kept:
        restored = max(baselines.values(), key=lambda b: b.accuracy).ref
        repromote(context.op_execution_context, make_local(storage, restored), evaluation.input_ref(POLICY), why)
        metadata[PROMOTED] = f"{restored.asset}@{restored.data_version}"
    return dg.AssetCheckResult(passed=kept, metadata=metadata, description=why)
