"""Where interaction logs land: local folders by default (the shipped samples), a team's folder or s3:// prefix
(``LandingResource.under``: ``BATCHRL_LANDING``) in production. An asset that reads a landing location names it in
its metadata (``landing_input``), so a run checks every location its assets read before anything runs."""
from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import Field

from batchrl.common.run_config_error import RunConfigError

SAMPLE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data")
#: every landing location, relative to a landing root: the shipped samples' layout, and a team's
LAYOUT = {"preferences": "preferences", "scored": "scored", "feedback": "feedback",
          "prompts": "arith/train.jsonl", "eval_prompts": "arith/eval.jsonl"}
#: asset metadata: the landing location (a ``LAYOUT`` key) the asset reads
LANDING_INPUT_KEY = "batchrl/landing_input"


def _sample(location: str) -> str:
    return os.path.join(SAMPLE_DATA, *LAYOUT[location].split("/"))


class LandingResource(dg.ConfigurableResource):
    """Locations (file, folder, glob or s3:// prefix) of each kind of input log."""

    preferences: str = Field(_sample("preferences"), description=(
        "preference log drops (prompt/chosen/rejected): each file or folder directly under this folder or s3:// "
        "prefix is one drop (a log_drops partition); a single file is one drop"))
    scored: str = Field(_sample("scored"), description="scored logs (prompt/response/score), "
                        "read whole by scored_logs: a file, folder, glob or s3:// prefix")
    feedback: str = Field(_sample("feedback"), description="unpaired thumbs feedback "
                          "(prompt/completion/label), read whole by feedback_logs: a file, folder, glob or s3:// "
                          "prefix")
    prompts: str = Field(_sample("prompts"), description="the RL training prompts the prompts asset reads")
    eval_prompts: str = Field(_sample("eval_prompts"), description="the held-out prompts the evaluation asset "
                              "answers")
    storage_options: dict[str, Any] = Field({}, description="fsspec options (endpoint, credentials) for s3:// "
                                            "landing locations; credentials are redacted in lineage")

    @classmethod
    def under(cls, root: str, storage_options: dict | None = None) -> LandingResource:
        """Every location under ``root`` (a team's folder or s3:// prefix, laid out as ``LAYOUT``): none falls back
        to the shipped samples, so a run never mixes them into the team's data (a location missing fails)."""
        root = root.rstrip("/")
        return cls(**{location: f"{root}/{relative}" for location, relative in LAYOUT.items()},
                   storage_options=storage_options or {})

    def missing(self, location: str, asset: str) -> str | None:
        """One line naming ``asset``, ``location`` and its path when nothing is landed there (None: inputs are)."""
        from batchrl.ingest.discover import discover_inputs  # the data plane's own rules: globs, hidden files

        uri = getattr(self, location)
        try:
            found = discover_inputs(uri, self.storage_options, hash_files=False)
        except FileNotFoundError:
            found = None
        if found:
            return None
        return f"{asset} reads landing.{location} = {uri}: {'nothing there' if found is None else 'no data file'}"

    def require(self, location: str, asset: str) -> str:
        """``location``'s URI, or a one-line ``dg.Failure`` naming what is missing (an asset's own check)."""
        problem = self.missing(location, asset)
        if problem:
            raise dg.Failure(f"{problem} ({HINT})")
        return getattr(self, location)


HINT = "land the logs there, or point BATCHRL_LANDING or resources.landing.<location> at them"


def landing_input(location: str) -> dict[str, str]:
    """The asset metadata declaring that the asset reads ``location``."""
    if location not in LAYOUT:
        raise ValueError(f"unknown landing location {location!r}: one of {sorted(LAYOUT)}")
    return {LANDING_INPUT_KEY: location}


class LandingInputMissing(RunConfigError):
    """A landing location that a selected asset reads holds nothing (raised before a run starts)."""


def check_landing_inputs(defs: dg.Definitions, jobs: list[dg.JobDefinition]) -> None:
    """Before anything runs: every landing location that an asset of ``jobs`` reads holds input, else one
    ``LandingInputMissing`` line naming each missing path and its asset (assets not selected need nothing)."""
    graph, landing = defs.resolve_asset_graph(), defs.resources["landing"]
    readers = {key.to_user_string(): graph.get(key).metadata.get(LANDING_INPUT_KEY)
               for job in jobs for key in job.asset_layer.executable_asset_keys}
    problems = [landing.missing(location, asset) for asset, location in sorted(readers.items()) if location]
    if any(problems):
        raise LandingInputMissing("; ".join(p for p in problems if p) + f" ({HINT}, or leave the asset out of "
                                  "--select: assets not selected need no input)")
