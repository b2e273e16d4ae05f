"""The Dagster code location: `dagster dev` (workspace.yaml) and `dagster asset materialize -m batchrl.definitions`.

Its assets (with their automation conditions), their checks, the jobs and sensors of ``assets.automation``, the
executor (step processes forked from ``runs.step_server``) and the resources of the environment
(``resources.environments``: ``BATCHRL_ENV``, with a profile's overrides). Running a selection of it is
``runs.execute``'s.
"""
from __future__ import annotations

import os

import dagster as dg

from batchrl.assets import automation, data, dpo, evaluation, models, offline, policy_chain, promotion, rl
from batchrl.common.environment_variables import read
from batchrl.resources import ArtifactIOManager, TrackingResource
from batchrl.resources.environments import environment_resources
from batchrl.resources.rl_recipe import RLRecipe
from batchrl.runs import step_server
from batchrl.runs.run_log import with_run_log


@dg.configured(with_run_log(dg.multiprocess_executor), config_schema={"max_concurrent": dg.Field(
    int, default_value=0, description="steps that may run at once (0: one per CPU core)")})
def step_executor(config: dict) -> dict:
    """Dagster's multiprocess executor with its step processes forked from ``batchrl.runs.step_server``; their
    output goes to the run's log file, not the console of `dagster dev` (``runs.run_log``)."""
    return {"max_concurrent": config["max_concurrent"],
            "start_method": {"forkserver": {"preload_modules": step_server.PRELOAD}}}


def build_definitions(resources: dict | None = None, dpo_self_play: bool | None = None) -> dg.Definitions:
    """The code location; ``resources`` overrides the environment's (tests pass their own). Assets hand each
    other artifacts through ``ArtifactIOManager`` on the same storage, unless ``resources`` has an io_manager;
    without a ``tracking`` resource, MLflow tracking is off; without ``rl_recipe``, the default RL recipe.
    ``dpo_self_play``: the DPO path may take self-play pairs (default ``dpo_takes_self_play_pairs()``)."""
    resources = resources or environment_resources()
    resources = {"io_manager": ArtifactIOManager(storage=resources["storage"]), "tracking": TrackingResource(),
                 "rl_recipe": RLRecipe(), **resources}  # the default RL recipe unless resources give one
    self_play = dpo_takes_self_play_pairs() if dpo_self_play is None else dpo_self_play
    return dg.Definitions(
        assets=automation.with_automation([*dg.load_assets_from_modules([data, models, rl, dpo, evaluation, offline]),
                                           dpo.dpo_pairs_asset(self_play), policy_chain.promoted_policy]),
        asset_checks=dg.load_asset_checks_from_modules([data, promotion]),
        jobs=[automation.retrain_job, automation.ingest_job, *_profile_jobs()],
        sensors=[automation.new_logs_sensor, automation.automation_sensor],
        executor=step_executor,
        resources=resources,
    )


def dpo_takes_self_play_pairs() -> bool:
    """Whether this code location's DPO path may take pairs from the policy's scored samples (``dpo_pairs``
    then has a ``rewards`` input): ``BATCHRL_DPO_SELF_PLAY`` (1 or 0), else whether the profile
    (``BATCHRL_PROFILE``) gives ``dpo_pairs`` the source self or both. Off (the default), the DPO path depends on
    the logged pairs alone and runs beside the RL branch; `batchrl run` turns it on when its run config asks."""
    from batchrl.resources.profiles import dpo_self_play, load_profile

    explicit = read("BATCHRL_DPO_SELF_PLAY")
    if explicit is not None:
        return explicit
    profile = read("BATCHRL_PROFILE")
    return bool(profile) and dpo_self_play(load_profile(profile)["ops"])


def _profile_jobs() -> list:
    """With ``BATCHRL_PROFILE`` set, a job ``<profile>_profile`` runs every asset with the profile's run
    config, so the UI launches it in one click (the launchpad shows the config, editable)."""
    from batchrl.resources.profiles import load_profile

    name = read("BATCHRL_PROFILE")
    if not name:
        return []
    profile = load_profile(name)
    job_name = "".join(c if c.isalnum() else "_" for c in os.path.basename(name).removesuffix(".yaml"))
    return [dg.define_asset_job(f"{job_name}_profile", selection=dg.AssetSelection.all(),
                                config={"ops": profile["ops"]} if profile["ops"] else None,
                                description=profile["description"])]


defs = build_definitions()
