"""The console scripts, one module each: train (grpo-train), eval (grpo-eval), reward
(grpo-reward-test), report (grpo-report), check_env (grpo-check-env), and sweep (how a grpo-train
multirun job ends); common holds what they share (composing and validating a config). Nothing
outside this package imports it.
"""
