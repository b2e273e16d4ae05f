"""Offline objectives beside the on-policy loop and the DPO path, with no new samples: a policy trained on
logged completions with rewards (scored logs, ``training/rl/offline_policy.py``) and KTO on unpaired thumbs
(feedback logs, ``training/trainer/kto.py``)."""
import os

import dagster as dg

from batchrl.assets.common import code_version, run_config_for, train_and_publish
from batchrl.resources import Artifact, CatalogResource, StorageResource, TrackingResource, TrainerLauncherResource
from batchrl.training.rl.offline_policy import OfflinePolicyConfig, has_logged_logprobs
from batchrl.training.trainer.config import KTOConfig

OfflinePolicyRunConfig = run_config_for(OfflinePolicyConfig, "OfflinePolicyRunConfig")
KTORunConfig = run_config_for(KTOConfig, "KTORunConfig")


@dg.asset(group_name="offline", kinds={"deepspeed"},
          code_version=code_version("batchrl.training.jobs.train_policy", "batchrl.training.rl.offline_policy",
                                    "batchrl.training.algos"))
def offline_policy_checkpoint(context: dg.AssetExecutionContext, config: OfflinePolicyRunConfig,
                              scored_logs: Artifact, base_model: Artifact, storage: StorageResource,
                              catalog: CatalogResource, trainer: TrainerLauncherResource,
                              tracking: TrackingResource) -> dg.Output:
    """The base model updated on the scored logs' completions (AWR, RWR, or GRPO over logged groups with
    optional truncated importance weights), on DeepSpeed via Pipes; KL to the base model as configured."""
    import pyarrow.parquet as pq

    offline = OfflinePolicyConfig.model_validate(config.model_dump())
    scored = os.path.join(storage.localize(scored_logs), "scored.parquet")
    if offline.importance_weights and not has_logged_logprobs(pq.read_table(scored), offline.logprobs_field):
        raise dg.Failure(f"offline_policy_checkpoint: importance_weights needs the logging policy's log-probs, but "
                         f"the scored logs ({scored_logs.data_version}) have no {offline.logprobs_field!r} field: map "
                         "it in the scored logs' config, set logprobs_field, or set importance_weights: false")
    job_config = {
        "trainer": offline.trainer_fields(),
        "logged": {"scored_parquet": scored,
                   "offline": offline.model_dump()},
        "model_path": base_model.path,
        "reference_model_path": base_model.path,
    }
    return train_and_publish(context, "train_policy", job_config,
                             {"scored_logs": scored_logs, "policy": base_model, "reference": base_model},
                             offline.seed, storage, catalog, trainer, tracking=tracking)


@dg.asset(group_name="offline", kinds={"deepspeed"},
          code_version=code_version("batchrl.training.jobs.train_kto", "batchrl.training.algos"))
def kto_checkpoint(context: dg.AssetExecutionContext, config: KTORunConfig, feedback_logs: Artifact,
                   base_model: Artifact, storage: StorageResource, catalog: CatalogResource,
                   trainer: TrainerLauncherResource, tracking: TrackingResource) -> dg.Output:
    """KTO of the base model on unpaired thumbs up/down (the feedback logs), its reference log-probs (the base
    model's, matched and mismatched pairs) computed and cached inside the job; on DeepSpeed via Pipes."""
    job_config = {"trainer": config.model_dump(),
                  "feedback_parquet": os.path.join(storage.localize(feedback_logs), "feedback.parquet"),
                  "model_path": base_model.path}
    return train_and_publish(context, "train_kto", job_config,
                             {"feedback_logs": feedback_logs, "base_model": base_model},
                             config.seed, storage, catalog, trainer, tracking=tracking)
