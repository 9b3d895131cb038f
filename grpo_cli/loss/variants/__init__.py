"""Loss variants: what `loss.loss_type` chooses, the policy term per token and its reduction to a
scalar (grpo_loss is the same for every variant: the KL penalty, the masks, the entropy bonus).

A variant is a plug-in (grpo_cli/plugins.py): one module declaring `PLUGIN = Plugin(...)`. The
modules of this package are the built-ins, each named by its file (`loss.loss_type=cispo` is
cispo.py); a user's is chosen by import path (`loss.loss_type=my_pkg.my_loss`), by the same rule
(plugins.load). What this package asks of it:

    build() -> Variant          the policy term and the reduction (its own stats, if any)
    options                     the dataclass of its own options (`loss.options.<key>`; the term
                                reads them as `cfg.options`), checked before the run
    check(lo) -> problems       its checks of the loss section `lo` (its options in range, what
                                it does not combine with), run by config validation
    facts                       none

A new built-in variant is its module here (its term in it, or in ../terms.py) and a preset
conf/loss/<name>.yaml; nothing else names it: config validation and the error messages take the
names from this package's modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from grpo_cli.loss.options import LossConfig
from grpo_cli.loss.reductions import Counts


class PolicyTerm(Protocol):
    """The per-token policy loss ``[B, T]`` from the importance ratio ``[B, T]``, the
    advantages ``[B, 1]`` and the loss section (see ``terms.py``)."""

    def __call__(self, ratio: Tensor, adv: Tensor, cfg: LossConfig, /) -> Tensor: ...


class Reduction(Protocol):
    """The scalar loss from the per-token loss ``[B, T]`` (0 where ``valid`` is False), the
    bool mask ``valid`` ``[B, T]`` and the step's counts (see ``reductions.py``)."""

    def __call__(self, per_token_loss: Tensor, valid: Tensor, counts: Counts, /) -> Tensor: ...


class VariantStats(Protocol):
    """A variant's own per-token stats: name -> ``[B, T]`` (bool or float) from the ratio
    ``[B, T]``, the advantages ``[B, 1]`` and the loss section; logged as their means over the
    tokens in the loss, under the names the variant declares (``Variant.stat_names``)."""

    def __call__(self, ratio: Tensor, adv: Tensor, cfg: LossConfig, /) -> dict[str, Tensor]: ...


@dataclass(frozen=True)
class Variant:
    """What a variant's build makes: the policy term per token and the reduction to a scalar, and
    its own stats with their names (the metrics' columns). Its options are its Plugin's."""

    policy_term: PolicyTerm
    reduce: Reduction
    stats: VariantStats | None = None
    stat_names: tuple[str, ...] = ()
