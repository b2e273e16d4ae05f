"""DeepSpeed trainer stages: reference log-probs, DPO, PPO/GRPO policy update, atomic checkpoints.

Import the stage modules directly (``batchrl.training.trainer.dpo`` ...); deepspeed itself is
imported only when an engine is built (``engine.init_deepspeed``).
"""
from batchrl.training.trainer.config import DPOConfig, PolicyConfig, TrainerConfig

__all__ = ["DPOConfig", "PolicyConfig", "TrainerConfig"]
