"""grpo-cli: config-driven GRPO training for causal language models."""

import logging as _logging

__version__ = "0.1.0"

# torchao (the memory-levers extra) is imported by PEFT whenever it is installed, and warns on
# every import about its CUDA kernels missing on a CPU and about torch's deprecations: noise in every
# run. Its real errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)


def __getattr__(name: str):
    """grpo_cli.train and grpo_cli.RunResult (grpo_cli/api.py), imported when first used, so that
    importing grpo_cli stays cheap."""
    if name in ("train", "RunResult"):
        from grpo_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpo_cli' has no attribute {name!r}")
