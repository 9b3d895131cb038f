"""loss.loss_type=bnpo: the clipped surrogate, normalised over the step's tokens (token mean)."""

from grpo_cli.loss.reductions import token_mean
from grpo_cli.loss.terms import clipped_surrogate
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin

PLUGIN = Plugin(name="bnpo", build=lambda: Variant(policy_term=clipped_surrogate, reduce=token_mean))
