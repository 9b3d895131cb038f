"""loss.loss_type=sapo (Soft Adaptive Policy Optimization, TRL loss_type="sapo"): a soft temperature
gate in place of the clip (terms.sapo); each sequence's mean, then the mean over the sequences, as
TRL; its options loss.options.temperature_pos and temperature_neg are the gate's temperatures."""

from __future__ import annotations

from typing import Any

from grpo_cli import plugins
from grpo_cli.loss.reductions import per_sequence_mean
from grpo_cli.loss.terms import SapoOptions, sapo, sapo_stats
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin


def check(lo: Any) -> list[str]:
    """Both temperatures in range (lo: the loss section, its options already read without error)."""
    options = plugins.read_options(PLUGIN, lo.options, "loss.options")
    problems = []
    for key in ("temperature_pos", "temperature_neg"):
        value = getattr(options, key)
        if not (isinstance(value, (int, float)) and value > 0):
            problems.append(
                f"loss.options.{key}={value!r} must be a number > 0 (the SAPO gate's temperature; "
                "TRL's defaults are 1.0 and 1.05)."
            )
    return problems


def build() -> Variant:
    return Variant(
        policy_term=sapo, reduce=per_sequence_mean, stats=sapo_stats, stat_names=("sapo/gate_mean",)
    )


PLUGIN = Plugin(name="sapo", build=build, options=SapoOptions, check=check)
