"""The reductions of the per-token loss to a scalar, one per normalisation a loss variant picks
(the table in ``grpo_cli/loss/__init__.py``); ref 000.6 and ref 004 (length bias).

``N`` is the number of sequences and ``M`` the number of valid tokens entering the loss over the
whole optimizer step, ``n_i`` the valid tokens of row ``i``, ``L`` = ``max_new_tokens``:

* :func:`per_sequence_mean` (``"grpo"``): ``sum_i (sum_t loss_it / n_i) / N``: every sequence
  weighs the same, so tokens of long completions weigh less (length bias).
* :func:`token_mean` (``"bnpo"`` / ``"dapo"``): ``sum_it loss_it / M``: every token weighs the
  same. On one device, normalised over the whole step, the two coincide; TRL only distinguishes
  them by how tokens are counted across processes.
* :func:`constant_length` (``"dr_grpo"``): ``sum_it loss_it / (N * L)``: a constant denominator.

Because ``N`` and ``M`` are step totals (from ``loss_normalizers``), each micro-batch loss is a
partial sum of the full-batch loss: summing micro-batch losses (no extra division by the number
of accumulation steps) gives exactly the full-batch loss and gradient. Nothing here assumes a
batch size. Every divisor is at least 1, so an empty batch gives 0.

A reduction is a pure function ``(per_token_loss [B, T], valid [B, T] bool, counts) -> []``;
``per_token_loss`` is already 0 wherever ``valid`` is False.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Counts:
    """The divisors of a reduction: the step's ``num_sequences`` (``N``) and ``num_tokens``
    (``M``) from ``loss_normalizers``, and ``max_new_tokens`` (``L``)."""

    num_sequences: int
    num_tokens: int
    max_new_tokens: int
    # Every trained token of the step, zero-std rows included: the teacher term's divisor (None:
    # the call's own).
    all_tokens: int | None = None


def _at_least_one(n: int) -> float:
    return float(max(int(n), 1))


def per_sequence_mean(per_token_loss: Tensor, valid: Tensor, counts: Counts) -> Tensor:
    """``sum_i (sum_t loss_it / n_i) / N`` (``loss_type="grpo"``)."""
    validf = valid.to(per_token_loss.dtype)  # [B, T]
    row_tokens = validf.sum(dim=1).clamp(min=1.0)  # [B]
    row_mean = per_token_loss.sum(dim=1) / row_tokens  # [B]
    return row_mean.sum() / _at_least_one(counts.num_sequences)  # []


def token_mean(per_token_loss: Tensor, valid: Tensor, counts: Counts) -> Tensor:
    """``sum_it loss_it / M`` (``loss_type="bnpo"`` and ``"dapo"``)."""
    return per_token_loss.sum() / _at_least_one(counts.num_tokens)  # []


def constant_length(per_token_loss: Tensor, valid: Tensor, counts: Counts) -> Tensor:
    """``sum_it loss_it / (N * L)`` (``loss_type="dr_grpo"``)."""
    return per_token_loss.sum() / (
        _at_least_one(counts.num_sequences) * _at_least_one(counts.max_new_tokens)
    )  # []
