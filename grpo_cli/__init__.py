"""grpo-cli: config-driven GRPO training for causal language models."""

__version__ = "0.1.0"
