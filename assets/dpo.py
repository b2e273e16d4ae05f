"""DPO path: pairs (logged and/or self-generated) → reference log-probs (frozen base) → dpo_checkpoint."""

import hashlib
import os
from typing import Optional

import dagster as dg
import pandas as pd
from pydantic import Field, field_validator

from batchrl.assets.common import code_version, declared_files, output_file, publish, run_config_for, train_and_publish
from batchrl.assets.run_rules import reference_mismatch, self_play_missing
from batchrl.assets.stage_configs import ReferenceConfig
from batchrl.ingest import IngestConfig
from batchrl.ingest.pairs import rewards_to_scored, scored_to_pairs
from batchrl.resources import (
    Artifact, CatalogResource, ComputeResource, StorageResource, TrackingResource, TrainerLauncherResource,
)
from batchrl.resources.artifacts import OPTIONAL_KEY
from batchrl.resources.profiles import pair_sources
from batchrl.training.trainer.config import DPOConfig

DPORunConfig = run_config_for(DPOConfig, "DPORunConfig")


class DPOPairsConfig(dg.Config):
    """Which pairs the DPO path trains on: ``logged`` (preference_window), ``self`` (best vs worst
    of the policy's own scored samples, e.g. correct vs incorrect answers, through the scored-logs →
    pairs path and its contract) or ``scored`` (best vs worst of the scored logs: ratings, stars, thumbs
    mapped to a score — the ``scored_pairs`` asset, its margin in its own config), or several joined by
    ``+`` (a window of mixed sources: ``logged+scored``; ``both`` = ``logged+self``). Each pair keeps where
    it came from (``source``: the log drop, ``scored`` or ``self``), which the evaluation reports per source.
    ``min_margin``: best − worst reward needed for a self pair; ``max_logged_pairs``: cap on the logged pairs
    taken (a seeded sample; all when unset)."""

    source: str = Field("logged", description=(
        "logged: preference_window; self: best vs worst of the policy's scored samples; scored: best vs worst "
        "of the scored logs (scored_pairs); several joined by '+' (logged+scored); both = logged+self (a self "
        "source needs dpo_pairs' rewards input: BATCHRL_DPO_SELF_PLAY=1 or such a profile)"))
    min_margin: float = Field(0.5, description="self: best - worst reward needed for a pair")
    max_logged_pairs: int | None = Field(None, description="a seeded sample of this many logged pairs (all when unset)")
    seed: int = Field(0, description="seed of the logged-pairs sample")

    @field_validator("source")
    @classmethod
    def _known_sources(cls, value: str) -> str:
        pair_sources(value)
        return value


def _pair_ids(pairs: pd.DataFrame) -> pd.Series:
    content = pairs["prompt"] + "\0" + pairs["chosen"] + "\0" + pairs["rejected"]
    hashed = content.map(lambda text: hashlib.sha256(text.encode()).hexdigest()[:16])
    return pairs["id"].where(pairs["id"].notna(), hashed) if "id" in pairs else hashed


def dpo_pairs_asset(self_play: bool) -> dg.AssetsDefinition:
    """The ``dpo_pairs`` asset of the code location. ``self_play``: it may take pairs from the policy's scored
    samples (``source: self|both``), so it has a ``rewards`` input and the DPO path waits for the RL branch's
    rollouts and scoring; without (``source: logged`` only), the DPO path depends on the logged pairs alone
    and runs beside the RL branch (``definitions.dpo_takes_self_play_pairs`` decides)."""
    decorator = dg.asset(name="dpo_pairs", group_name="dpo", kinds={"parquet", "pandera"},
                         code_version=code_version("batchrl.ingest.pairs", config=DPOPairsConfig),
                         metadata=declared_files(table="preferences.parquet"),
                         ins={"scored_pairs": dg.AssetIn(metadata={OPTIONAL_KEY: True})})
    if self_play:
        def dpo_pairs(context: dg.AssetExecutionContext, config: DPOPairsConfig, preference_window: Artifact,
                      scored_pairs: Optional[Artifact], rewards: Artifact, storage: StorageResource,
                      catalog: CatalogResource) -> dg.Output:
            """The preference pairs of the DPO path (one id per pair), from the configured source."""
            return _pairs(context, config, preference_window, scored_pairs, rewards, storage, catalog)
    else:
        def dpo_pairs(context: dg.AssetExecutionContext, config: DPOPairsConfig, preference_window: Artifact,
                      scored_pairs: Optional[Artifact], storage: StorageResource,
                      catalog: CatalogResource) -> dg.Output:
            """The preference pairs of the DPO path (one id per pair): the logged ones or the scored logs' (this
            code location's DPO path does not wait for the policy's samples; BATCHRL_DPO_SELF_PLAY=1 builds it
            with them)."""
            problem = self_play_missing(config.source, has_rewards_input=False)
            if problem:
                raise dg.Failure(problem)
            return _pairs(context, config, preference_window, scored_pairs, None, storage, catalog)
    return decorator(dpo_pairs)


PAIR_COLUMNS = ["prompt", "chosen", "rejected", "prompt_messages", "category"]


def _pairs(context: dg.AssetExecutionContext, config: DPOPairsConfig, preference_window: Artifact,
           scored_pairs: Artifact | None, rewards: Artifact | None, storage: StorageResource,
           catalog: CatalogResource) -> dg.Output:
    sources = pair_sources(config.source)
    parts, metadata = [], {"source": config.source}
    if "logged" in sources:
        logged = preference_window.read_table()
        if config.max_logged_pairs and len(logged) > config.max_logged_pairs:
            logged = logged.sample(config.max_logged_pairs, random_state=config.seed).sort_index()
        parts.append(logged.assign(pair_source="logged/" + logged["drop"]))
        metadata["logged_pairs"] = len(logged)
    if "scored" in sources:
        if scored_pairs is None:
            raise dg.Failure(f"dpo_pairs: source {config.source!r} takes the scored logs' pairs, but scored_pairs has "
                             "never been materialised: materialise scored_logs and scored_pairs first")
        scored = scored_pairs.read_table()
        parts.append(scored[PAIR_COLUMNS].assign(pair_source="scored/" + scored["source_file"]))
        metadata["scored_pairs"] = len(scored)
    with storage.staging_dir("dpo_pairs") as staging:
        if "self" in sources:
            scored_dir = os.path.join(staging, "self")
            os.makedirs(scored_dir)
            samples = rewards.read_table()
            rewards_to_scored(samples, os.path.join(scored_dir, "scored.parquet"), f"rewards/{rewards.data_version}")
            report = scored_to_pairs(os.path.join(scored_dir, "scored.parquet"), scored_dir,
                                     IngestConfig(pair_min_margin=config.min_margin))
            parts.append(pd.read_parquet(os.path.join(scored_dir, "pairs.parquet"))[PAIR_COLUMNS].assign(
                pair_source="self"))
            metadata.update(self_pairs=len(parts[-1]), self_prompt_groups=report.rows_in,
                            self_groups_without_pair=report.quarantined, self_samples=len(samples))
        pairs = pd.concat(parts, ignore_index=True)
        if pairs.empty:
            raise dg.Failure(f"dpo_pairs: source {config.source!r} gave no preference pairs "
                             "(self: no prompt had samples whose rewards differ by min_margin)")
        pairs["id"] = _pair_ids(pairs)
        pairs = pairs.drop_duplicates("id", ignore_index=True)
        pairs.to_parquet(output_file(context, staging), index=False)
        inputs = {"preference_window": preference_window, **({"rewards": rewards} if rewards is not None else {}),
                  **({"scored_pairs": scored_pairs} if "scored" in sources else {})}
        per_source = {str(k): int(v) for k, v in pairs["pair_source"].value_counts().sort_index().items()}
        return publish(context, storage, catalog, staging, config=config.model_dump(), inputs=inputs,
                       metadata={**metadata, "pairs": len(pairs), "pairs_per_source": per_source})


@dg.asset(group_name="dpo", code_version=code_version("batchrl.training.trainer.reference", config=ReferenceConfig), kinds={"pytorch"},
          metadata=declared_files(table="reference_logprobs.parquet"))
def reference_logprobs(context: dg.AssetExecutionContext, config: ReferenceConfig, dpo_pairs: Artifact,
                       base_model: Artifact, storage: StorageResource, catalog: CatalogResource,
                       compute: ComputeResource, trainer: TrainerLauncherResource) -> dg.Output:
    """Summed completion log-probs of chosen and rejected under the frozen reference (base) model (on the
    environment's compute: in process on the CPU, in a Pipes job on the GPU)."""
    with storage.staging_dir("reference_work") as workdir, storage.staging_dir("reference_logprobs") as staging:
        stats = compute.run(context, trainer, "reference_logprobs", {
            "model_path": base_model.path, "pairs_parquet": dpo_pairs.file(), "out_parquet": output_file(context, staging),
            "max_length": config.max_length, "batch_size": config.batch_size, "batch_tokens": config.batch_tokens,
            "device": compute.device, "dtype": config.dtype}, workdir=workdir)
        return publish(context, storage, catalog, staging, config=config.model_dump(),
                       inputs={"dpo_pairs": dpo_pairs, "reference": base_model},
                       metadata={k: v for k, v in stats.items() if isinstance(v, (int, float, str)) and k != "path"})


def reference_max_length(reference_logprobs: Artifact) -> int:
    """The truncation the reference log-probs were computed with (their recorded config)."""
    recorded = reference_logprobs.lineage.get("config", {})
    return int(recorded.get("max_length", ReferenceConfig.model_fields["max_length"].default))


@dg.asset(group_name="dpo", code_version=code_version("batchrl.training.jobs.train_dpo", "batchrl.training.algos"),
          kinds={"deepspeed"})
def dpo_checkpoint(context: dg.AssetExecutionContext, config: DPORunConfig, dpo_pairs: Artifact,
                   reference_logprobs: Artifact, base_model: Artifact, storage: StorageResource,
                   catalog: CatalogResource, trainer: TrainerLauncherResource,
                   tracking: TrackingResource) -> dg.Output:
    """DPO-family preference optimisation of the base model, on DeepSpeed via Pipes."""
    # a reference from an earlier run, which no up-front check saw: refused before the job starts, not inside it
    problem = reference_mismatch(reference_max_length(reference_logprobs), config.max_length, materialised=True)
    if problem:
        raise dg.Failure(problem)
    job_config = {
        "trainer": config.model_dump(),
        "pairs_parquet": dpo_pairs.file(),
        "reference_parquet": reference_logprobs.file(),
        "model_path": base_model.path,
    }
    return train_and_publish(context, "train_dpo", job_config,
                             {"dpo_pairs": dpo_pairs,
                              "reference_logprobs": reference_logprobs, "base_model": base_model},
                             config.seed, storage, catalog, trainer, tracking=tracking)
