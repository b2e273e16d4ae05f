"""Evaluation: base vs policy vs DPO checkpoints on held-out arithmetic and on the preference pairs."""

import json
import os
from typing import Literal, Optional

import dagster as dg
from pydantic import Field

from batchrl.assets.charts import grouped_bars
from batchrl.assets.common import code_version, declared_files, publish
from batchrl.assets.data_quality import printable
from batchrl.assets.dpo import reference_max_length
from batchrl.assets.iteration_chart import EVALUATED_BASE, EVALUATION, drawn_or_logged
from batchrl.assets.policy_chain import CHAIN, ITERATION, input_iteration
from batchrl.assets.stage_configs import AgentRunConfig, PromptFormatConfig
from batchrl.common import fsutil
from batchrl.resources import (
    Artifact, CatalogResource, ComputeResource, LandingResource, StorageResource, TrainerLauncherResource,
)
from batchrl.resources.artifacts import OPTIONAL_KEY
from batchrl.resources.landing import landing_input
from batchrl.training.data.prompts import load_prompts


class EvaluationConfig(PromptFormatConfig):
    """Greedy evaluation on the held-out prompts. ``reward``: what counts as correct (a registered
    reward: ``arith_exact`` = first integer, ``final_answer`` = the final number / after ``####``)."""

    max_new_tokens: int = Field(12, description="greedy decoding length per answer")
    reward: str = Field("arith_exact", description="the registered reward that decides correct (e.g. arith_exact, "
                        "final_answer)")
    format_reward: Optional[str] = Field(None, description="a registered reward that decides whether an answer is in "
                                         "the task's format (format_rate; e.g. format_gsm8k: '#### N' or a boxed "
                                         "number); unset: no format_rate")
    max_eval_prompts: int | None = Field(None, description="evaluate the first N held-out prompts (all when unset)")
    num_examples: int = Field(3, description="sample answers per model shown in the UI")
    seed: int = Field(0, description="seed of evaluation's sampling")
    max_regression: float = Field(0.05, ge=0.0, le=1.0, description="held-out accuracy (a fraction) the policy may "
                                  "lose against the base model and the previously evaluated policy and stay promoted "
                                  "(the blocking check policy_not_regressed; 1.0: never withdrawn)")
    regression_test: Literal["point", "paired"] = Field(
        "point", description="how policy_not_regressed judges a loss beyond max_regression: point = the accuracies "
        "alone; paired = only a significant one withdraws the policy (question by question against that baseline: "
        "the 95% interval of the policy's paired gain lies below 0), for held-out sets small enough that one run's "
        "noise exceeds the margin")
    agent: Optional[AgentRunConfig] = Field(None, description="also answer the held-out prompts with tools "
                                            "(docs/AGENT.md): tool_accuracy beside arith_accuracy (no tools), "
                                            "mean_tool_calls, tool_error_rate")


OFFLINE_MODELS = ("offline_policy_checkpoint", "kto_checkpoint")  # compared once materialised
RESULTS_FILE = "evaluation.json"


@dg.asset(group_name="evaluation", code_version=code_version("batchrl.training.evaluation.evaluate", "batchrl.training.agent",
                                                                       config=EvaluationConfig),
          kinds={"pytorch"}, ins={name: dg.AssetIn(metadata={OPTIONAL_KEY: True}) for name in OFFLINE_MODELS},
          metadata={**landing_input("eval_prompts"), **declared_files(results=RESULTS_FILE)})
def evaluation(context: dg.AssetExecutionContext, config: EvaluationConfig, policy_checkpoint: Artifact,
               dpo_checkpoint: Artifact, base_model: Artifact, reward_model: Artifact, dpo_pairs: Artifact,
               reference_logprobs: Artifact, offline_policy_checkpoint: Optional[Artifact],
               kto_checkpoint: Optional[Artifact], landing: LandingResource, storage: StorageResource,
               catalog: CatalogResource, compute: ComputeResource, trainer: TrainerLauncherResource) -> dg.Output:
    """Greedy held-out accuracy (overall and per category), preference accuracy/margin and RM score
    for the base, policy and DPO checkpoints (and the offline objectives' once materialised), side by side."""
    landing.require("eval_prompts", "evaluation")  # a missing file: one line naming it, not a traceback
    eval_prompts = load_prompts(landing.eval_prompts, landing.storage_options, shape=config.shape,
                                suffix=config.prompt_suffix)
    if config.max_eval_prompts:
        eval_prompts = eval_prompts.head(config.max_eval_prompts)
    fs, path = fsutil.filesystem_for(landing.eval_prompts, landing.storage_options)
    pairs_parquet = dpo_pairs.file()
    reference = dpo_pairs.read_table(columns=["id"]).merge(reference_logprobs.read_table(), on="id", how="left",
                                                           validate="one_to_one")
    models = {"base_model": base_model, "policy_checkpoint": policy_checkpoint, "dpo_checkpoint": dpo_checkpoint}
    offline = {"offline_policy_checkpoint": offline_policy_checkpoint, "kto_checkpoint": kto_checkpoint}
    models.update({name: artifact for name, artifact in offline.items() if artifact is not None})
    pair_max_length, base_is_reference = reference_pass(reference_logprobs, base_model, compute)
    options = dict(reward_model_path=reward_model.path, max_new_tokens=config.max_new_tokens,
                   pair_max_length=pair_max_length, reference_model="base_model" if base_is_reference else None,
                   paired_with="base_model",  # each model's held-out gain over the base, question by question
                   with_scores=True,  # evaluation.json keeps per-question scores: the gate's paired test
                   seed=config.seed, reward=config.reward, format_reward=config.format_reward, num_examples=config.num_examples, device=compute.device,
                   dtype=compute.dtype, batch_size=compute.batch_size, engine=compute.generation_engine,
                   agent=None if config.agent is None else config.agent.model_dump())
    with storage.staging_dir("evaluation_work") as workdir:
        eval_prompts.to_parquet(os.path.join(workdir, "eval_prompts.parquet"), index=False)
        reference.to_parquet(os.path.join(workdir, "reference.parquet"), index=False)
        results = compute.run(context, trainer, "evaluation", {
            "models": {name: artifact.path for name, artifact in models.items()},
            "eval_prompts_parquet": os.path.join(workdir, "eval_prompts.parquet"), "pairs_parquet": pairs_parquet,
            "reference_parquet": os.path.join(workdir, "reference.parquet"), "options": options}, workdir=workdir)
    results = rounded(results)
    shown = {model: without_single_group_copies(metrics) for model, metrics in results.items()}
    with storage.staging_dir("evaluation") as staging:
        with open(os.path.join(staging, RESULTS_FILE), "w") as f:
            json.dump(results, f, indent=2, sort_keys=True)
        flat = {f"{model}/{metric}": value for model, metrics in shown.items()
                for metric, value in metrics.items() if isinstance(value, (int, float))}
        flat.update(_chain_position(context, policy_checkpoint, base_model, flat))
        return publish(context, storage, catalog, staging, seed=config.seed, config=config.model_dump(),
                       inputs={**models, "reward_model": reward_model, "dpo_pairs": dpo_pairs,
                               "reference_logprobs": reference_logprobs},
                       input_files=[{"uri": landing.eval_prompts, "sha256": fsutil.sha256_file(fs, path)}],
                       metadata={**flat, "comparison": _comparison_table(shown),
                                 "comparison_chart": dg.MetadataValue.md(
                                     grouped_bars(overlay_panels(shown)).markdown("models side by side")),
                                 "examples": dg.MetadataValue.md(_examples_markdown(results))})


def _chain_position(context: dg.AssetExecutionContext, policy: Artifact, base_model: Artifact, flat: dict) -> dict:
    """Where the evaluated policy stands in its RL chain (its iteration and ``chain_base``, as the RL stages tag
    theirs), the base model evaluated beside it, and the chain's iteration chart with this evaluation's numbers in
    it (held-out accuracy against the iteration: ``batchrl run --eval-every K``); {} for a policy of no known
    iteration."""
    position = input_iteration(context.instance, policy)
    if ITERATION not in position or CHAIN not in position:
        return {}
    own = {**flat, EVALUATED_BASE: f"base_model@{base_model.data_version}"}
    chart = drawn_or_logged(context.log, context.instance, position[CHAIN], position[ITERATION], {EVALUATION: own})
    return {**position, EVALUATED_BASE: own[EVALUATED_BASE], **chart}


def reference_pass(reference_logprobs: Artifact, base_model: Artifact, compute: ComputeResource) -> tuple[int, bool]:
    """How the reference log-probs were computed, from their lineage: (their truncation, which the models'
    pair log-probs must share — a log-ratio margin over other tokens means nothing —, whether the pass is the
    base model's own at this environment's precision: then evaluation takes it instead of running it again)."""
    recorded = reference_logprobs.lineage.get("config", {})
    dtype = recorded.get("dtype", "auto")
    if dtype == "auto":  # ReferenceConfig's rule
        dtype = "bfloat16" if compute.device.startswith("cuda") else "float32"
    model = reference_logprobs.input_ref("reference")
    same_pass = model is not None and model.data_version == base_model.data_version and dtype == compute.dtype
    return reference_max_length(reference_logprobs), same_pass


def rounded(value, digits: int = 6):
    """Metrics at ``digits`` decimals: float noise between runtimes (threads, kernels, a subprocess or not) in the
    last bits of a mean must not give the same evaluation another data version."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def _comparison_table(results: dict) -> dg.MetadataValue:
    """One row per metric, one column per model: what the UI shows first."""
    metrics = sorted({m for r in results.values() for m, v in r.items() if isinstance(v, (int, float))})
    header = "| metric | " + " | ".join(results) + " |\n|---|" + "---|" * len(results) + "\n"
    rows = [f"| {m} | " + " | ".join(_fmt(r.get(m)) for r in results.values()) + " |" for m in metrics]
    return dg.MetadataValue.md(header + "\n".join(rows))


def _fmt(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _examples_markdown(results: dict) -> str:
    lines = []
    for model, r in results.items():
        for ex in r.get("examples", []):
            answer = _cell(ex["response"].replace("\n", " ")[:160])
            prompt, gold = _cell(ex["prompt"][:80]), _cell(str(ex["answer"]))
            lines.append(f"| {model} | {ex.get('category', '')} | {prompt} | {answer} | {gold} |")
    return "| model | category | prompt | response | gold |\n|---|---|---|---|---|\n" + "\n".join(lines)


def _cell(text: str) -> str:
    """Model output as a Markdown table cell: control characters escaped (shown as ``\\x07``, not boxes), no
    cell breaks."""
    return printable(text).replace("|", "/")


# a family of per-group metrics (``accuracy/<category>``) and the key of its value over all groups
OVERALL = {"accuracy": "arith_accuracy", "n": "arith_n", "preference_accuracy": "preference_accuracy",
           "preference_n": "preference_n", "logratio_accuracy": "logratio_accuracy"}


UNCERTAINTY = ("_stderr", "_ci95_low", "_ci95_high", "_questions_won", "_questions_lost")  # training.evaluation.paired


def without_single_group_copies(metrics: dict) -> dict:
    """``metrics`` less a per-group family of one group equal to its overall value (one category ``arith``:
    ``accuracy/arith`` repeats ``arith_accuracy``, ``n/arith`` repeats ``arith_n``); evaluation.json keeps all."""
    dropped = set()
    for family, overall in OVERALL.items():
        groups = [key for key in metrics if key.startswith(f"{family}/")]
        if len(groups) == 1 and metrics[groups[0]] == metrics.get(overall):
            dropped.add(groups[0])
    return {key: value for key, value in metrics.items() if key not in dropped}


def overlay_panels(results: dict) -> dict[str, dict[str, dict[str, float]]]:
    """``{metric: {group: {model: value}}}`` for the side-by-side chart: a panel per metric (its per-category or
    per-source values as groups beside ``all``), counts and the numbers around a gain or accuracy (standard error,
    interval, questions won and lost: the table shows them) left out."""
    panels: dict[str, dict[str, dict[str, float]]] = {}
    overall_of = {overall: family for family, overall in OVERALL.items()}
    for model, metrics in results.items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            family, _, group = key.partition("/")
            family = overall_of.get(key, family) if not group else family
            if family == "n" or family.endswith(("_n", *UNCERTAINTY)):
                continue
            panels.setdefault(family, {}).setdefault(group or "all", {})[model] = value
    return panels
