"""Evaluation: base vs policy vs DPO checkpoints on held-out arithmetic and on the preference pairs."""

import json
import os

import dagster as dg

from batchrl import fsutil
from batchrl.assets.common import code_version, publish
from batchrl.assets.models import read_parquet_in
from batchrl.resources import CatalogResource, LandingResource, StorageResource
from batchrl.training.prompts import load_prompts


class EvaluationConfig(dg.Config):
    max_new_tokens: int = 12
    seed: int = 0


@dg.asset(group_name="evaluation", code_version=code_version("batchrl.training.evaluate"), kinds={"pytorch"})
def evaluation(context: dg.AssetExecutionContext, config: EvaluationConfig, policy_checkpoint: dict,
               dpo_checkpoint: dict, base_model: dict, reward_model: dict, validated_preferences: dict,
               reference_logprobs: dict,
               landing: LandingResource, storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Greedy rule-reward accuracy, preference accuracy/margin and RM score for each model."""
    from batchrl.training.evaluate import evaluate_policy

    eval_prompts = load_prompts(landing.eval_prompts, landing.storage_options)
    fs, path = fsutil.filesystem_for(landing.eval_prompts, landing.storage_options)
    pairs = read_parquet_in(storage, validated_preferences, "preferences.parquet")
    reference = pairs[["id"]].merge(read_parquet_in(storage, reference_logprobs, "reference_logprobs.parquet"),
                                    on="id", how="left", validate="one_to_one")
    models = {"base_model": base_model, "policy_checkpoint": policy_checkpoint, "dpo_checkpoint": dpo_checkpoint}
    results = {
        name: evaluate_policy(storage.localize(ref), arith_eval=eval_prompts.to_dict("records"), pairs=pairs,
                              reward_model_path=storage.localize(reward_model),
                              max_new_tokens=config.max_new_tokens, seed=config.seed, reference=reference)
        for name, ref in models.items()
    }
    with storage.staging_dir("evaluation") as staging:
        with open(os.path.join(staging, "evaluation.json"), "w") as f:
            json.dump(results, f, indent=2, sort_keys=True)
        flat = {f"{model}/{metric}": value for model, metrics in results.items()
                for metric, value in metrics.items() if isinstance(value, (int, float))}
        return publish(context, storage, catalog, staging, seed=config.seed, config=config.model_dump(),
                       inputs={**models, "reward_model": reward_model, "validated_preferences": validated_preferences,
                               "reference_logprobs": reference_logprobs},
                       input_files=[{"uri": landing.eval_prompts, "sha256": fsutil.sha256_file(fs, path)}],
                       metadata=flat)
