"""loss.loss_type=dapo: the clipped surrogate, normalised over the step's tokens (token mean); DAPO's
clip-higher and masked truncated completions are options of their own (conf/loss/dapo.yaml)."""

from grpo_cli.loss.reductions import token_mean
from grpo_cli.loss.terms import clipped_surrogate
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin

PLUGIN = Plugin(name="dapo", build=lambda: Variant(policy_term=clipped_surrogate, reduce=token_mean))
