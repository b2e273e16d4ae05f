"""DPO path: validated pairs → reference log-probs (frozen base) → dpo_checkpoint."""

import os

import dagster as dg

from batchrl.assets.common import code_version, publish, run_config_for, train_and_publish
from batchrl.resources import CatalogResource, StorageResource, TrainerLauncherResource
from batchrl.training.trainer.config import DPOConfig

DPORunConfig = run_config_for(DPOConfig, "DPORunConfig")


class ReferenceConfig(dg.Config):
    max_length: int = 256
    batch_size: int = 16
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU


def _pairs_path(storage: StorageResource, validated_preferences: dict) -> str:
    return os.path.join(storage.localize(validated_preferences), "preferences.parquet")


@dg.asset(group_name="dpo", code_version=code_version("batchrl.training.trainer.reference"), kinds={"pytorch"})
def reference_logprobs(context: dg.AssetExecutionContext, config: ReferenceConfig, validated_preferences: dict,
                       base_model: dict, storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Summed completion log-probs of chosen and rejected under the frozen reference (base) model."""
    from batchrl.training.trainer.reference import compute_reference_logprobs

    with storage.staging_dir("reference_logprobs") as staging:
        stats = compute_reference_logprobs(storage.localize(base_model), _pairs_path(storage, validated_preferences),
                                           os.path.join(staging, "reference_logprobs.parquet"),
                                           max_length=config.max_length, batch_size=config.batch_size,
                                           dtype=config.dtype)
        return publish(context, storage, catalog, staging, config=config.model_dump(),
                       inputs={"validated_preferences": validated_preferences, "reference": base_model},
                       metadata={k: v for k, v in stats.items() if isinstance(v, (int, float, str))})


@dg.asset(group_name="dpo", code_version=code_version("batchrl.training.trainer", "batchrl.training.algos"),
          kinds={"deepspeed"})
def dpo_checkpoint(context: dg.AssetExecutionContext, config: DPORunConfig, validated_preferences: dict,
                   reference_logprobs: dict, base_model: dict, storage: StorageResource,
                   catalog: CatalogResource, trainer: TrainerLauncherResource) -> dg.Output:
    """DPO-family preference optimisation of the base model, on DeepSpeed via Pipes."""
    job_config = {
        "trainer": config.model_dump(),
        "pairs_parquet": _pairs_path(storage, validated_preferences),
        "reference_parquet": os.path.join(storage.localize(reference_logprobs), "reference_logprobs.parquet"),
        "model_path": storage.localize(base_model),
    }
    return train_and_publish(context, "train_dpo", job_config,
                             {"validated_preferences": validated_preferences,
                              "reference_logprobs": reference_logprobs, "base_model": base_model},
                             config.seed, storage, catalog, trainer)
