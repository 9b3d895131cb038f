"""Goodness-of-fit checks of a sampler's draws, shared by the built-in sampler's tests and vLLM's.

Two views of "these tokens come from that distribution":

- one position, many draws: the counts of each token against its probability (`chi2_fits`);
- every position of many sampled sequences, each from a distribution of its own: the rank of the
  sampled token under the model's distribution there, in K+1 categories (rank 1, ..., rank K,
  beyond K), counted over all positions, against the summed probabilities of those categories
  (`rank_categories`, then `fits`). A draw biased toward the head or the tail of the distribution
  shifts these counts; the positions are independent given their prefixes, so Pearson's statistic
  is at most chi-square distributed (the test is conservative).

Every threshold is df + 6 sqrt(2 df): a false alarm about once in a million runs.
"""

from __future__ import annotations

import math

import torch


def pooled(counts: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0):
    """Bins with fewer than min_expected counts pooled into one (the chi-square rule)."""
    small = expected < min_expected
    return (
        torch.cat([counts[~small], counts[small].sum(0, keepdim=True)]),
        torch.cat([expected[~small], expected[small].sum(0, keepdim=True)]),
    )


def statistic(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of observed counts against expected ones."""
    obs, exp = pooled(observed.double(), expected.double())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def fits(observed: torch.Tensor, expected: torch.Tensor) -> bool:
    stat, df = statistic(observed, expected)
    return stat < df + 6 * math.sqrt(2 * df)


def chi2_fits(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Token counts at one position drawn from p (a distribution over the vocabulary)?"""
    return fits(counts.double(), p.double() * counts.sum())


def rank_categories(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, K: int = 10):
    """(observed, expected) counts of the sampled tokens' ranks, over every position of `mask`.

    logits [B, C, V]: the model's (tempered, truncated as sampled) logits that score each of the
    sampled tokens [B, C]; mask [B, C]: the positions to count."""
    p = logits.double().softmax(-1)  # [B, C, V]
    px = p.gather(-1, tokens[..., None])  # [B, C, 1]
    rank = (p > px).sum(-1).clamp(max=K)  # [B, C], 0-based, K = beyond the top K
    top = p.topk(K, dim=-1).values  # [B, C, K]
    mass = torch.cat([top, (1 - top.sum(-1, keepdim=True)).clamp(min=0)], -1)  # [B, C, K+1]
    valid = mask.bool()
    observed = torch.nn.functional.one_hot(rank, K + 1).double()[valid].sum(0)  # [K+1]
    return observed, mass[valid].sum(0)
