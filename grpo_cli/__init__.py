"""grpo-cli: config-driven GRPO training for causal language models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """grpo_cli.train and grpo_cli.RunResult (grpo_cli/api.py), imported when first used, so that
    importing grpo_cli stays cheap."""
    if name in ("train", "RunResult"):
        from grpo_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpo_cli' has no attribute {name!r}")
