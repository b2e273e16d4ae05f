"""The batchrl arms of bench_gpu_rl_vs_trl.py other than ``full``: each one's run config over the task's profile
(``-c`` of ``batchrl run``), as the bench's docstring lists them."""

ARM_CONFIGS = {"lora": {"ops": {"policy_checkpoint": {"config": {"lora_rank": 32, "lora_alpha": 32, "lr": 1.0e-4}}}},
               # LoRA gained most in minutes (GSM8K, 2026-12-06: +4.1 points in 5.5 min at 1e-4): does 2x help more?
               "lora_lr2": {"ops": {"policy_checkpoint": {"config": {"lora_rank": 32, "lora_alpha": 32,
                                                                      "lr": 2.0e-4}}}},
               # 5x the profile's lr (gsm8k: 1e-5): does a faster policy move GSM8K greedy accuracy in minutes?
               "hi_lr": {"ops": {"policy_checkpoint": {"config": {"lr": 1.0e-5}}}},
               # hi_lr with DAPO's answers to overlong/looping answers and signal-free groups (issue 48): the soft
               # overlong penalty over the last 128 of 512 tokens, and groups with identical rewards dropped
               "dapo": {"ops": {"policy_checkpoint": {"config": {"lr": 1.0e-5}},
                                "rewards": {"config": {"overlong_buffer": {"length": 128, "penalty_factor": 1.0}}},
                                "advantages": {"config": {"dynamic_sampling": True}}}},
               "eager": {"ops": {"policy_checkpoint": {"config": {"torch_compile": False}}}},
               "rollout_old": {"ops": {}, "resources": {"rl_recipe": {"old_logprobs": "rollout"}}},
               # no KL term (DAPO's and Dr. GRPO's choice, TRL's default beta 0): no reference pass in the update
               # (half of its fixed log-prob pass: ~2.2 s of a 23 s GSM8K iteration on the H100)
               # (kl_loss_coef back at its default: rl_recipe refuses a field that placement none does not read)
               "no_kl": {"ops": {}, "resources": {"rl_recipe": {"kl_placement": "none", "kl_loss_coef": 0.01}}},
               # both fixed log-prob passes gone: old log-probs from the sampling engine (the same weights, in the
               # same process when sampled ahead) and no reference: the update is AdamW's steps and the export
               "lean": {"ops": {}, "resources": {"rl_recipe": {"old_logprobs": "rollout", "kl_placement": "none",
                                                               "kl_loss_coef": 0.01}}},
               # one-step off-policy: the next iteration's rollouts sampled by the rollouts worker during the update
               "off_policy": {"ops": {}, "resources": {"rl_recipe": {"off_policy_steps": 1, "sample_ahead": False}}},
               # each update samples the next iteration from its new weights while it exports them (the profile's)
               "no_ahead": {"ops": {}, "resources": {"rl_recipe": {"sample_ahead": False}}},
               # rollouts on vLLM (issue 48): a fresh process and engine per step, or the engine kept in the job
               # worker, asleep between steps, each new checkpoint copied in (no sampling ahead: vLLM's own process)
               "vllm_fresh": {"ops": {}, "resources": {
                   "rollout_engine": {"kind": "vllm", "gpu_memory_utilization": 0.35},
                   "rl_recipe": {"sample_ahead": False}}},
               "vllm_resident": {"ops": {}, "resources": {
                   "rollout_engine": {"kind": "vllm", "vllm_resident": True, "gpu_memory_utilization": 0.35},
                   "rl_recipe": {"sample_ahead": False}}},
               # one AdamW over the iterations, as TRL's (its moments published with each checkpoint)
               "carry": {"ops": {"policy_checkpoint": {"config": {"carry_optimizer_state": True}}}},
               # between the profile's stable 2e-6 and the lr 1e-5 that collapsed the dapo arm (RESULTS, 2026-12-06),
               # with the carried AdamW (a new one's first steps are ~1.5x larger)
               "carry_lr4": {"ops": {"policy_checkpoint": {"config": {"carry_optimizer_state": True,
                                                                       "lr": 4.0e-6}}}}}
