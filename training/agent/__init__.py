"""Multi-turn, tool-using rollouts (issue 35): ``AgentConfig``, ``AgentRollouts``; ``docs/AGENT.md``."""
from batchrl.training.agent.config import AgentConfig
from batchrl.training.agent.loop import AgentRollouts, turn_generator

__all__ = ["AgentConfig", "AgentRollouts", "turn_generator"]
