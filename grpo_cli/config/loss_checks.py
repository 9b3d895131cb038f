"""The loss group's bounds, checked before any model loads (config.validation calls
loss_problems; here, not in grpo_cli.loss: that package imports torch, so the variant's name,
options and its own checks, variant_problems, import it only when called)."""

from __future__ import annotations

import math
from typing import Any


def _adaptive_entropy_problems(lo: Any) -> list[str]:
    """TRL's adaptive entropy control's keys (loss.use_adaptive_entropy=true)."""
    problems = []
    if not (math.isfinite(lo.entropy_target) and lo.entropy_target > 0):
        problems.append(
            f"loss.entropy_target={lo.entropy_target} must be a positive number of nats per token: the "
            "entropy the controller holds the policy at (TRL's default 0.2)."
        )
    if not (0 <= lo.entropy_coef_min <= lo.entropy_coef_max and math.isfinite(lo.entropy_coef_max)):
        problems.append(
            f"loss.entropy_coef_min={lo.entropy_coef_min} and loss.entropy_coef_max={lo.entropy_coef_max} "
            "must satisfy 0 <= min <= max < inf: the bounds of the adaptive coefficient (TRL: 0 and 1)."
        )
    elif not lo.entropy_coef_min <= lo.entropy_coef <= lo.entropy_coef_max:
        problems.append(
            f"loss.entropy_coef={lo.entropy_coef} is the adaptive controller's starting coefficient and "
            f"must lie in [loss.entropy_coef_min, loss.entropy_coef_max] = [{lo.entropy_coef_min}, "
            f"{lo.entropy_coef_max}]; set it inside (0 starts from no bonus)."
        )
    if not (math.isfinite(lo.entropy_coef_delta) and lo.entropy_coef_delta > 0):
        problems.append(
            f"loss.entropy_coef_delta={lo.entropy_coef_delta} must be a positive number: the step the "
            "adaptive coefficient moves by after each step (TRL's default 0.005)."
        )
    return problems


def loss_problems(lo: Any) -> list[str]:
    """The loss group's bounds (here, not in grpo_cli.loss: that package imports torch)."""
    problems = []
    if not 0 < lo.epsilon < 1:
        problems.append(f"loss.epsilon={lo.epsilon} must be in (0, 1); 0.2 is the usual value.")
    if lo.epsilon_high is not None and not 0 < lo.epsilon_high < 1:
        problems.append(
            f"loss.epsilon_high={lo.epsilon_high} must be in (0, 1) (or null to reuse epsilon); "
            "DAPO uses 0.28."
        )
    if lo.delta is not None and not lo.delta > 1:
        problems.append(f"loss.delta={lo.delta} must be > 1 (it caps the ratio), or null to disable.")
    if not (isinstance(lo.top_entropy_quantile, (int, float)) and 0 < lo.top_entropy_quantile <= 1):
        problems.append(
            f"loss.top_entropy_quantile={lo.top_entropy_quantile} must be in (0, 1]: the share of each "
            "micro-batch's tokens, by entropy, that the policy term trains on (0.2: the top 20%; 1.0: all)."
        )
    if not math.isfinite(lo.entropy_coef):
        problems.append(f"loss.entropy_coef={lo.entropy_coef} must be a finite number (0: no entropy bonus).")
    if lo.use_adaptive_entropy:
        problems += _adaptive_entropy_problems(lo)
    if lo.tis_min is not None and not 0 <= lo.tis_min < lo.tis_cap:
        problems.append(
            f"loss.tis_min={lo.tis_min} must be >= 0 and below loss.tis_cap={lo.tis_cap} (the band a "
            "sequence's ratio to the sampler must lie in), or null for no lower bound."
        )
    if lo.off_policy_mask_threshold is not None and not lo.off_policy_mask_threshold > 0:
        problems.append(
            f"loss.off_policy_mask_threshold={lo.off_policy_mask_threshold} must be > 0 (a mean per-token KL; "
            "DeepSeek-V3.2 and TRL suggest about 0.5), or null to keep every sequence."
        )
    if not lo.tis_cap > 0:
        problems.append(
            f"loss.tis_cap={lo.tis_cap} must be > 0 (it caps the TIS weights); 2.0 is the usual value."
        )
    if not lo.beta >= 0:
        problems.append(f"loss.beta={lo.beta} must be >= 0; use 0 to train without a reference model.")
    return problems + variant_problems(lo)


def variant_problems(lo: Any) -> list[str]:
    """loss.loss_type's problems, one rule for a built-in and a user's variant: its name (a module
    of grpo_cli/loss/variants/ or an import path) and that its build makes a Variant, its options
    (`loss.options`, read into its options dataclass), then its own check of the loss section."""
    from grpo_cli import loss, plugins
    from grpo_cli.errors import UserError

    try:
        declared = plugins.load(loss.VARIANTS, lo.loss_type, "loss.loss_type")
        loss.variant(lo.loss_type)
        plugins.read_options(declared, lo.options, "loss.options")
    except (ValueError, UserError) as exc:
        return [str(exc)]
    return declared.problems(lo)
