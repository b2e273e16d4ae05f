"""Rewards: the registry and rule rewards (``registry``), math answers (``math_answers``), code run against tests
(``code_tests``, in the sandbox), a learned reward model (``reward_model``) and the KL penalty in the reward
(``kl_in_reward``).

The built-in families register themselves with the registry when imported; importing the package imports them, so
whoever reads the registry (through ``batchrl.training.rewards.registry``) sees every built-in name.
"""
from batchrl.training.rewards import code_tests, math_answers, registry  # noqa: F401  (registration on import)
