"""Job: PPO/GRPO policy update. Config JSON: ``{"trainer": PolicyConfig fields, "batch_parquet",
"model_path", "reference_model_path", "critic_path" (with trainer.critic), "out_dir", "sample_ahead"}``
(``sample_ahead``: the next iteration's rollouts request, ``training/rollout/ahead.py``).

On logged completions (``training/rl/offline_policy.py``) the job gets ``"logged": {"scored_parquet",
"offline": OfflinePolicyConfig fields}`` instead of ``batch_parquet`` and builds the batch itself (with the
model's tokenizer, here rather than in the Dagster process), into ``out_dir``."""
from __future__ import annotations

import os
import sys

from batchrl.training.jobs._runtime import Reporter, run_job


def logged_batch_parquet(logged: dict, model_path: str, out_dir: str, rep: Reporter) -> tuple[str, dict]:
    """The batch of an update on logged completions, written once into ``out_dir`` (a resumed job reuses it)."""
    import pandas as pd

    from batchrl.training.rl.offline_policy import OfflinePolicyConfig, logged_batch
    from batchrl.training.models.loading import load_tokenizer

    path = os.path.join(out_dir, "logged_batch.parquet")
    batch, metrics = logged_batch(pd.read_parquet(logged["scored_parquet"]), load_tokenizer(model_path),
                                  OfflinePolicyConfig.model_validate(logged["offline"]))
    if not os.path.exists(path):
        batch.to_parquet(f"{path}.tmp", index=False)
        os.replace(f"{path}.tmp", path)
    rep.log(f"train_policy: logged batch {metrics}")
    return path, metrics


def work(config: dict, rep: Reporter):
    from batchrl.training.trainer.config import PolicyConfig
    from batchrl.training.trainer.policy import train_policy

    cfg = PolicyConfig.model_validate(config.get("trainer", {}))
    rep.log(f"train_policy: {cfg.model_dump_json()}")
    batch_parquet, logged_metrics = config.get("batch_parquet"), {}
    if "logged" in config:
        os.makedirs(config["out_dir"], exist_ok=True)
        batch_parquet, logged_metrics = logged_batch_parquet(config["logged"], config["model_path"],
                                                             config["out_dir"], rep)
    result = train_policy(cfg, batch_parquet=batch_parquet, model_path=config["model_path"],
                          reference_model_path=config.get("reference_model_path"),
                          critic_path=config.get("critic_path"),
                          out_dir=config["out_dir"], report=rep.step, sample_ahead=config.get("sample_ahead"))
    result.update({f"logged_{k}": v for k, v in logged_metrics.items()})
    return result, result.get("model_dir")


def main() -> int:
    """A job process of its own: its sampling ahead is written before the process ends."""
    code = run_job(work)
    ahead = sys.modules.get("batchrl.training.rollout.ahead")
    if ahead is not None:
        ahead.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
