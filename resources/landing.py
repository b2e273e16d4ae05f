"""Where interaction logs land: local folders by default (the shipped samples), s3:// in production."""
from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import Field

SAMPLE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data")


class LandingResource(dg.ConfigurableResource):
    """Locations (file, folder, glob or s3:// prefix) of each kind of input log."""

    preferences: str = Field(os.path.join(SAMPLE_DATA, "preferences"), description=(
        "preference log drops (prompt/chosen/rejected): each file or folder directly under this folder or s3:// "
        "prefix is one drop (a log_drops partition); a single file is one drop"))
    scored: str = Field(os.path.join(SAMPLE_DATA, "scored"), description="scored logs (prompt/response/score), "
                        "read whole by scored_logs: a file, folder, glob or s3:// prefix")
    feedback: str = Field(os.path.join(SAMPLE_DATA, "feedback"), description="unpaired thumbs feedback "
                          "(prompt/completion/label), read whole by feedback_logs: a file, folder, glob or s3:// "
                          "prefix")
    prompts: str = Field(os.path.join(SAMPLE_DATA, "arith", "train.jsonl"), description="the RL training prompts "
                         "the prompts asset reads")
    eval_prompts: str = Field(os.path.join(SAMPLE_DATA, "arith", "eval.jsonl"), description="the held-out prompts "
                              "the evaluation asset answers")
    storage_options: dict[str, Any] = Field({}, description="fsspec options (endpoint, credentials) for s3:// "
                                            "landing locations; credentials are redacted in lineage")
