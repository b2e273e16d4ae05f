"""Where rollouts sampled before their step asked for them wait to be taken: one folder per sampling request.

Two producers (issue 32): the one-step off-policy prefetch (``assets/rollout_prefetch.py``: the rollouts worker
samples the next iteration from a published policy) and on-policy sampling ahead (``training/rollout/ahead.py``:
the policy update's job samples the next iteration from the weights it has just trained, while it exports them).
Both name the folder by the request the next rollouts step will make — the policy's asset and data version, the
prompts, their conversations, n, the seed, the agent settings and the engine's — so the step finds it by asking
exactly that. Stdlib only: the Dagster process and the jobs compute the same name.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

FOLDER = "rollout_prefetch"  # under the storage cache
STATS_FILE = "stats.json"  # written last: the samples beside it are complete
SAMPLES_FILE = "samples.parquet"
AHEAD_MARK = "sampled_ahead.json"  # in a folder the policy update's job fills: {"pid": ...}


def request_parts(asset: str, data_version: str | None, prompts: list[str], messages: list | None, n: int,
                  seed: int, agent: dict | None, engine: dict[str, Any]) -> list:
    """The request as the folder's name is made of (``data_version`` None: filled in once the policy is hashed)."""
    return [asset, data_version, prompts, messages, n, seed, agent, engine]


def request_folder(root: str, parts: list, data_version: str | None = None) -> str:
    """The folder of the request ``parts`` under ``root`` (``data_version``: the policy's, where parts lack it)."""
    if data_version is not None:
        parts = [parts[0], data_version, *parts[2:]]
    key = json.dumps(parts, sort_keys=True, default=str)
    return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:16])


def sampled_ahead(folder: str) -> dict | None:
    """The mark of a folder the policy update's job fills (its pid), else None."""
    try:
        with open(os.path.join(folder, AHEAD_MARK)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
