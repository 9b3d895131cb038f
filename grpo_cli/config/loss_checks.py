"""The loss group's bounds, checked before any model loads (config.validation calls
loss_problems; here, not in grpo_cli.loss: that package imports torch)."""

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
    from grpo_cli import loss, plugins
    from grpo_cli.errors import UserError

    try:  # a row of the loss table, or a user's variant by import path, with its own options
        row = loss.variant(lo.loss_type)
        declared = (
            plugins.load("grpo_cli.loss", lo.loss_type, "loss.loss_type")
            if plugins.is_import_path(lo.loss_type)
            else plugins.Plugin(name=lo.loss_type, build=lambda: row, options=row.options)
        )
        options = plugins.read_options(declared, lo.options, "loss.options")
        problems += _variant_problems(lo, options)
    except (ValueError, UserError) as exc:
        problems.append(str(exc))
    return problems


def _variant_problems(lo: Any, options: Any) -> list[str]:
    """The built-in variants' own options in range, and what they do not combine with."""
    from grpo_cli.loss.terms import CispoOptions, SapoOptions

    problems = []
    if isinstance(options, CispoOptions):
        if not (isinstance(options.weight_max, (int, float)) and options.weight_max > 0):
            problems.append(
                f"loss.options.weight_max={options.weight_max!r} must be a number > 0 (the cap on CISPO's "
                "importance weight; 5.0 is TRL's recommended value)."
            )
        if lo.importance_sampling_level == "sequence":
            problems.append(
                "loss.loss_type=cispo weights each token by its own ratio; loss.importance_sampling_level="
                "sequence does not apply to it (TRL refuses the pair too): set it to token, or choose "
                "loss=gspo for sequence-level ratios."
            )
    if isinstance(options, SapoOptions):
        for key in ("temperature_pos", "temperature_neg"):
            value = getattr(options, key)
            if not (isinstance(value, (int, float)) and value > 0):
                problems.append(
                    f"loss.options.{key}={value!r} must be a number > 0 (the SAPO gate's temperature; "
                    "TRL's defaults are 1.0 and 1.05)."
                )
    return problems
