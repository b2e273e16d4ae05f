"""Where interaction logs land: local folders by default (the shipped samples), s3:// in production."""
from __future__ import annotations

import os
from typing import Any

import dagster as dg

SAMPLE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data")


class LandingResource(dg.ConfigurableResource):
    """Locations (file, folder, glob or s3:// prefix) of each kind of input log."""

    preferences: str = os.path.join(SAMPLE_DATA, "preferences")
    scored: str = os.path.join(SAMPLE_DATA, "scored")
    feedback: str = os.path.join(SAMPLE_DATA, "feedback")  # unpaired thumbs: prompt/completion/label
    prompts: str = os.path.join(SAMPLE_DATA, "arith", "train.jsonl")
    eval_prompts: str = os.path.join(SAMPLE_DATA, "arith", "eval.jsonl")
    storage_options: dict[str, Any] = {}
