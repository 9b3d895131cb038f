"""loss.loss_type=grpo: the clipped surrogate, each sequence's mean over its tokens, then the mean
over the sequences (the GRPO paper's reduction)."""

from grpo_cli.loss.reductions import per_sequence_mean
from grpo_cli.loss.terms import clipped_surrogate
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin

PLUGIN = Plugin(name="grpo", build=lambda: Variant(policy_term=clipped_surrogate, reduce=per_sequence_mean))
