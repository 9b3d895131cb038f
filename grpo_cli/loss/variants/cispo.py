"""loss.loss_type=cispo (MiniMax-M1, TRL loss_type="cispo"): the clipped importance weight, detached,
times log p (terms.cispo), normalised over the step's tokens, as TRL does; its option
loss.options.weight_max caps the weight."""

from __future__ import annotations

from typing import Any

from grpo_cli import plugins
from grpo_cli.loss.reductions import token_mean
from grpo_cli.loss.terms import CispoOptions, cispo, cispo_stats
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin


def check(lo: Any) -> list[str]:
    """The cap in range, and no sequence-level ratio (lo: the loss section, its options already
    read without error)."""
    options = plugins.read_options(PLUGIN, lo.options, "loss.options")
    problems = []
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
    return problems


def build() -> Variant:
    return Variant(policy_term=cispo, reduce=token_mean, stats=cispo_stats, stat_names=("cispo_clip_ratio",))


PLUGIN = Plugin(name="cispo", build=build, options=CispoOptions, check=check)
