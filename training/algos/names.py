"""The names run configs may give the RL functions, known without importing torch.

A run config is checked (and the Dagster UI lists its choices) when the definitions load, long before
any tensor math runs; importing torch for that cost ~3-4 s of every ``batchrl run``'s start on the GPU
host. So the choices live here, torch-free, and each function still registers itself next to its
definition (``registry.register_adv_estimator``/``register_policy_loss``), which checks that its name and
needs are the ones declared here; a test checks that every name here has its function.

- ``ADV_ESTIMATOR_NEEDS``: estimator -> what its inputs need beyond token-level rewards and the response
  mask (``groups``: several responses per prompt; ``values``: a critic's per-token predictions;
  ``reward_baselines``: one baseline score per response, ReMax's greedy reward);
- ``POLICY_LOSS_NAMES``: the policy losses (``compute_policy_loss``'s signature);
- ``KL_ALIASES``/``KL_KINDS``: the KL estimators ``kl.kl_penalty`` accepts (k1..k3, abs; "+" = k2's gradient).
"""
from __future__ import annotations

NEEDS = ("groups", "values", "reward_baselines")
ADV_ESTIMATOR_NEEDS: dict[str, frozenset[str]] = {
    "gae": frozenset({"values"}),
    "grpo": frozenset({"groups"}),
    "drgrpo": frozenset({"groups"}),
    "rloo": frozenset({"groups"}),
    "reinforce_plus_plus": frozenset(),
    "reinforce_plus_plus_baseline": frozenset({"groups"}),
    "remax": frozenset({"reward_baselines"}),
}
POLICY_LOSS_NAMES = ("vanilla", "gspo", "weighted_regression")
KL_ALIASES = {"k1": "kl", "kl": "kl", "k2": "mse", "mse": "mse", "k3": "low_var_kl", "low_var_kl": "low_var_kl",
              "abs": "abs"}
KL_KINDS = (*KL_ALIASES, *(f"{kind}+" for kind in KL_ALIASES))  # every name kl_penalty accepts
