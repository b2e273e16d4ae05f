"""The storage root's layout, derived here only, and references that stay valid when a root is copied or moved.

<root>/<asset>/<data version>/   a published artifact (lineage.json inside)
<root>/catalog.duckdb            the catalog (always local: beside a local root, or the local root of an s3 env)
<root>/_cache/                   staging, downloads of an s3 root, trainer work dirs, compile caches
"""
from __future__ import annotations

import os
from typing import Any

from batchrl.common.environment_variables import VARIABLES, read

CATALOG_FILE = "catalog.duckdb"
CACHE_FOLDER = "_cache"
DEFAULT_ROOT = VARIABLES["BATCHRL_STORAGE"].default  # ".storage", relative to the working dir


def local_storage_root() -> str:
    """The local storage root in use: ``BATCHRL_STORAGE``, else ``./.storage`` (absolute)."""
    return read("BATCHRL_STORAGE")


def catalog_path_of(root: str) -> str:
    return os.path.join(root, CATALOG_FILE)


def cache_dir_of(root: str) -> str:
    return os.path.join(root, CACHE_FOLDER)


def artifact_path(asset: str, data_version: str) -> str:
    """Where an artifact lies relative to its storage root."""
    return f"{asset}/{data_version}"


def artifact_uri(root: str, asset: str, data_version: str) -> str:
    return f"{root.rstrip('/')}/{artifact_path(asset, data_version)}" if "://" in root \
        else os.path.join(root, asset, data_version)


def root_of(artifact_uri: str) -> str:
    """The storage root of a published artifact (``<root>/<asset>/<data version>``)."""
    return artifact_uri.rstrip("/").rsplit("/", 2)[0]


def rooted_uri(uri: str, asset: str, data_version: str, root: str) -> str:
    """Where the artifact recorded as ``uri`` lies under ``root``, the storage root in use now. A reference
    is its path relative to the root it was published in (lineage, catalog ``path``); an absolute one (Dagster
    event metadata, older records) is read the same way, by its ``<asset>/<data version>`` tail, so a root
    copied or moved with its Dagster home resolves to itself and never to the original. Anything else is
    no artifact of a storage root: refused (refs travel through Dagster and JSON)."""
    tail = artifact_path(asset, data_version)
    recorded = uri.rstrip("/")
    if recorded != tail and not recorded.endswith("/" + tail):
        raise ValueError(f"artifact {uri!r} is outside the storage root {root!r} (not <root>/{tail})")
    return artifact_uri(root, asset, data_version)


def input_uri(entry: dict, consumer_uri: str) -> str:
    """Where an input recorded in the lineage of the artifact at ``consumer_uri`` lies: in the same root."""
    return rooted_uri(entry["uri"], entry["asset"], entry["data_version"], root_of(consumer_uri))


def relative_to_root(value: Any, root: str) -> Any:
    """``value`` with every string under ``root`` written relative to it (dicts and lists walked)."""
    prefix = root.rstrip("/") + "/"
    if isinstance(value, str):
        return value[len(prefix):] if value.startswith(prefix) else value
    if isinstance(value, dict):
        return {k: relative_to_root(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_to_root(v, root) for v in value]
    return value
