"""Model assets: the embedded default base model and the Bradley-Terry reward model."""

import os
import shutil

import dagster as dg
import pandas as pd

from batchrl.assets.common import code_version, publish
from batchrl.resources import CatalogResource, StorageResource


class BaseModelConfig(dg.Config):
    """``model_path`` set: that HF model folder is the base model. Unset: build the tiny default."""

    model_path: str | None = None
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    seed: int = 0


class RewardModelConfig(dg.Config):
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 16
    max_length: int = 256
    seed: int = 0


def read_parquet_in(storage: StorageResource, ref: dict, name: str) -> pd.DataFrame:
    return pd.read_parquet(os.path.join(storage.localize(ref), name))


@dg.asset(group_name="models", code_version=code_version("batchrl.training.tiny_model"), kinds={"pytorch"})
def base_model(context: dg.AssetExecutionContext, config: BaseModelConfig, validated_preferences: dict,
               prompts: dict, storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Tiny Qwen2 + byte-level BPE tokenizer trained offline on the data (or a user-supplied HF folder)."""
    from batchrl.training.tiny_model import build_tiny_model

    with storage.staging_dir("base_model") as staging:
        if config.model_path:
            shutil.copytree(config.model_path, staging, dirs_exist_ok=True)
            info = {"source": config.model_path}
        else:
            prefs = read_parquet_in(storage, validated_preferences, "preferences.parquet")
            texts = [*prefs["prompt"], *prefs["chosen"], *prefs["rejected"],
                     *read_parquet_in(storage, prompts, "prompts.parquet")["prompt"]]
            dims = config.model_dump(exclude={"model_path"})
            info = build_tiny_model(texts, staging, **dims)
        return publish(context, storage, catalog, staging, seed=config.seed, config=config.model_dump(),
                       inputs={"validated_preferences": validated_preferences, "prompts": prompts},
                       metadata={k: v for k, v in info.items() if isinstance(v, (int, float, str))})


@dg.asset(group_name="models", code_version=code_version("batchrl.training.reward_model"), kinds={"pytorch"})
def reward_model(context: dg.AssetExecutionContext, config: RewardModelConfig, validated_preferences: dict,
                 scored_pairs: dict, base_model: dict, storage: StorageResource,
                 catalog: CatalogResource) -> dg.Output:
    """Bradley-Terry reward model on the validated pairs plus pairs mined from scored logs."""
    from batchrl.training.reward_model import train_reward_model

    pairs = pd.concat([read_parquet_in(storage, validated_preferences, "preferences.parquet"),
                       read_parquet_in(storage, scored_pairs, "pairs.parquet")], ignore_index=True)
    with storage.staging_dir("reward_model") as staging:
        metrics = train_reward_model(pairs, storage.localize(base_model), staging, **config.model_dump())
        return publish(context, storage, catalog, staging, seed=config.seed, config=config.model_dump(),
                       inputs={"validated_preferences": validated_preferences, "scored_pairs": scored_pairs,
                               "base_model": base_model},
                       metadata={"pairs": len(pairs), **metrics})
