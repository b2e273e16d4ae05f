"""The persistent Dagster instance of the commands (``DAGSTER_HOME``, default ./.dagster_home) and the artifacts
its latest materialisations point to."""
from __future__ import annotations

import os

# the settings of a Dagster home batchrl makes (its dagster.yaml): no telemetry, no first-run notice, and concurrency
# pools of one step by default, so one step of the `batchrl_catalog` pool runs at a time (two log drops never write
# the catalog at once; docs/PARTITIONS.md). Storage: Dagster's default, sqlite files in the home.
INSTANCE_SETTINGS = {
    "telemetry": {"enabled": False},
    "nux": {"enabled": False},
    "concurrency": {"pools": {"default_limit": 1}},
}
INSTANCE_FILE = "dagster.yaml"


def write_instance_settings(home: str) -> str:
    """``home``'s dagster.yaml holding ``INSTANCE_SETTINGS`` (replaced if there); returns its path."""
    import yaml

    path = os.path.join(home, INSTANCE_FILE)
    with open(path, "w") as f:
        yaml.safe_dump(INSTANCE_SETTINGS, f, sort_keys=False)
    return path


def ensure_dagster_home() -> str:
    """A persistent DAGSTER_HOME (default ./.dagster_home) so runs and lineage survive restarts; a new one gets
    batchrl's dagster.yaml, one that has a dagster.yaml keeps it."""
    home = os.path.abspath(os.environ.get("DAGSTER_HOME") or ".dagster_home")
    os.makedirs(home, exist_ok=True)
    if not os.path.exists(os.path.join(home, INSTANCE_FILE)):
        write_instance_settings(home)
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
    """An artifact folder; ``asset/data_version`` as lineage names an input (under this environment's storage root,
    an S3 root's artifact fetched into the cache) where no such folder is here; or the latest materialisation of an
    asset named ``target``."""
    if "://" in target:
        return target
    if os.path.isdir(target):
        return os.path.abspath(target)
    if "/" in target:
        return _stored_artifact(target) or os.path.abspath(target)
    ensure_dagster_home()
    with open_instance() as instance:
        return latest_uri(instance, target)


def _stored_artifact(target: str) -> str | None:
    """The local folder of ``asset/data_version`` under the storage root, if it is there."""
    parts = target.strip("/").split("/")
    if len(parts) != 2:
        return None
    from batchrl.resources.environments import environment_resources

    storage = environment_resources()["storage"]
    ref = {"asset": parts[0], "data_version": parts[1], "uri": f"{storage.root_uri()}/{parts[0]}/{parts[1]}"}
    try:
        folder = storage.localize(ref, expired_ok=True)  # audit and reproduce read an expired one's lineage
    except (ValueError, OSError, FileNotFoundError):  # not a safe name, or no such artifact there
        return None
    return folder if os.path.isdir(folder) else None
