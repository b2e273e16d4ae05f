"""Keep credentials out of everything batchrl writes: lineage, metadata, the catalog, logs.

Credentials come from the environment (AWS_* variables, ``dg.EnvVar`` in resource config), never from
run config. This is the second line: any mapping key that names a secret has its value replaced before
a record is written, whatever its nesting (e.g. ``storage_options.secret``).
"""
from __future__ import annotations

import re
from typing import Any

#: whole key names or suffixes that hold secrets (``aws_secret_access_key``, ``key``, ``session_token``, ...),
#: not mere mentions (``tokens_per_s``, ``max_new_tokens`` stay)
SECRET_KEY = re.compile(r"(^|[_-])(secret|secret_key|secret_access_key|password|passwd|token|api_key|access_key|"
                        r"access_key_id|key_id|private_key|credentials?|authorization)$|^key$", re.IGNORECASE)
REDACTED = "<redacted>"


def redact(value: Any) -> Any:
    """A copy of ``value`` with the values of secret-looking keys replaced by ``<redacted>``."""
    if type(value) is dict:  # exact types: Dagster's metadata records are tuples that refuse iteration
        return {k: REDACTED if isinstance(k, str) and SECRET_KEY.search(k) and v not in (None, "", {}, [])
                else redact(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(redact(v) for v in value)
    return value
