"""The persistent Dagster instance of the commands (``DAGSTER_HOME``, default ./.dagster_home) and the artifacts
its latest materialisations point to."""
from __future__ import annotations

import os

# concurrency pools: one step of the `batchrl_catalog` pool at a time (two log drops never write the
# catalog at once; docs/PARTITIONS.md)
DAGSTER_YAML = "telemetry:\n  enabled: false\nnux:\n  enabled: false\nconcurrency:\n  pools:\n    default_limit: 1\n"


def ensure_dagster_home() -> str:
    """A persistent DAGSTER_HOME (default ./.dagster_home) so runs and lineage survive restarts."""
    home = os.path.abspath(os.environ.get("DAGSTER_HOME") or ".dagster_home")
    os.makedirs(home, exist_ok=True)
    config = os.path.join(home, "dagster.yaml")
    if not os.path.exists(config):
        with open(config, "w") as f:
            f.write(DAGSTER_YAML)
    os.environ["DAGSTER_HOME"] = home
    return home


def open_instance():
    """The persistent instance; its storages' revision checks read Dagster's scripts once (``alembic_scripts``)."""
    import dagster as dg

    from batchrl.runs import alembic_scripts

    alembic_scripts.share()
    return dg.DagsterInstance.get()


def latest_uri(instance, asset: str) -> str | None:
    """Where the latest materialisation of ``asset`` lies under this environment's storage root: a root copied
    with its Dagster home answers with its own copy, not the folder the event recorded."""
    import dagster as dg

    from batchrl.resources.artifacts import latest_ref
    from batchrl.resources.environments import environment_resources

    ref = latest_ref(instance, dg.AssetKey(asset))
    return environment_resources()["storage"].locate(ref).uri if ref else None


def target_uri(target: str) -> str | None:
    """An artifact folder, or the latest materialisation of an asset named ``target``."""
    if "/" in target or os.path.isdir(target):
        return os.path.abspath(target) if "://" not in target else target
    ensure_dagster_home()
    with open_instance() as instance:
        return latest_uri(instance, target)
