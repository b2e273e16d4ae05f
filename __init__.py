"""batchrl: offline batch-RL post-training for LLMs, orchestrated by Dagster."""

__version__ = "0.1.0"
