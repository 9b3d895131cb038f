"""The allowed values of the loss section's string options, the check that names them, and the
compute dtype every function of the package works in.

``loss_type`` is not here: its values are the rows of the loss table, ``grpo_cli.loss.LOSSES``.
"""

from __future__ import annotations

from typing import Any

import torch

# Log-ratios and KL log-differences are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]
# before exp(). exp(20) ~ 4.9e8 is finite in float16/bfloat16/float32. The clamp is
# flat outside the range, so tokens beyond it get zero gradient through that term.
LOG_RATIO_CLAMP = 20.0

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # normalize_then_sum: GDPO
STD_KINDS = ("population", "sample")
ESTIMATORS = ("grpo", "rloo")
IS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
ZERO_STD_MODES = ("mask", "weight", "keep")
# tis: truncated_importance_weights; sequence_mask: sequence_mask_weights; auto: config.schema
SAMPLER_CORRECTIONS = ("auto", "none", "tis", "sequence_mask")


def _check_choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name}={value!r}; valid values: {', '.join(repr(v) for v in valid)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 or higher: bf16/fp16 (and integer rewards) are upcast, float64 is kept.
    return torch.promote_types(dtype, torch.float32)


#: The loss section a loss function reads by attribute: config.schema.LossConfig. Named, not
#: imported: config's validation reads this package's table (the loss_type names), so the math
#: stays below config and imports none of it.
LossConfig = Any
