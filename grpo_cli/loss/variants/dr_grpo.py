"""loss.loss_type=dr_grpo: the clipped surrogate, summed and divided by a constant, the number of
sequences times the configured completion limit (Dr. GRPO: no sequence's length weighs its tokens)."""

from grpo_cli.loss.reductions import constant_length
from grpo_cli.loss.terms import clipped_surrogate
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin

PLUGIN = Plugin(name="dr_grpo", build=lambda: Variant(policy_term=clipped_surrogate, reduce=constant_length))
