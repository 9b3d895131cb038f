"""The built-in sampler's low-level parts (samplers/builtin.py's decode loop, sample and Session
use them): left padding, the CPU decode linears (few_rows_linears), the float64 CDF draws
(sampling_cdf, draw) and the per-seed uniforms, and the KV-cache state a batch keeps between
decode calls (_DecodeState, _prefilled). Private (its name starts with "_"): not a sampler backend.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_cli.logprobs import prefill
from grpo_cli.models import recurrent
from grpo_cli.rollout import left_pad


def _few_rows_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear for a handful of rows on a CPU: W @ x^T instead of x @ W^T. Same numbers up to
    float rounding; MKL runs this operand order several times faster when x has few rows (a
    decode step: one token per sequence), e.g. 17 ms vs 68 ms for SmolLM2's 49k x 576 output
    layer with 8 rows on a 2-core CPU. Not for bf16 weights: oneDNN's bf16 x @ W^T is the faster
    order there (4.2 ms vs 5.5 ms for that layer, and no transposing copy)."""
    rows = x.numel() // x.shape[-1]
    if rows > 64 or x.device.type != "cpu" or self.weight.dtype == torch.bfloat16:
        return F.linear(x, self.weight, self.bias)
    xt = x.reshape(rows, x.shape[-1]).t()  # [in, rows]
    # The bias goes into the same op (addmm), not added after mm: under bf16 autocast mm returns
    # bf16 and bf16 + fp32 bias promotes to fp32, where F.linear returns bf16. addmm, like
    # linear, is an autocast op: all three operands are cast alike, so the dtype matches F.linear.
    if self.bias is None:
        y = torch.mm(self.weight, xt)  # [out, rows]
    else:
        y = torch.addmm(self.bias[:, None], self.weight, xt)  # [out, rows]
    return y.t().contiguous().view(*x.shape[:-1], y.shape[0])


# Layer -> how many open few_rows_linears blocks use it. A layer is patched when its count goes
# 0 -> 1 and unpatched when it goes back to 0: two samplers on one model (threads, nested
# blocks, a block on a submodule) never unpatch layers the other still runs.
_patch_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_patch_lock = threading.Lock()


class few_rows_linears:
    """Within the block, the model's plain nn.Linear layers use _few_rows_linear (an instance
    attribute, removed when the last block using it exits: nothing outside the blocks or of
    other models changes). Re-entrant and thread-safe."""

    def __init__(self, model):
        self.model = model
        self._held: list[list[torch.nn.Linear]] = []  # per open block: the layers it counted

    def __enter__(self):
        with _patch_lock:
            layers = [
                m
                for m in self.model.modules()
                if type(m) is torch.nn.Linear and (m in _patch_counts or "forward" not in m.__dict__)
            ]  # ours, or unpatched
            for layer in layers:
                count = _patch_counts.get(layer, 0)
                if count == 0:
                    layer.forward = _few_rows_linear.__get__(layer)
                _patch_counts[layer] = count + 1
            self._held.append(layers)
        return self

    def __exit__(self, *exc):
        with _patch_lock:
            for layer in self._held.pop():
                _patch_counts[layer] -= 1
                if _patch_counts[layer] == 0:
                    del _patch_counts[layer]
                    layer.__dict__.pop("forward", None)
        return False


# Rows per float64 CDF chunk on a CPU: ~6 MB, one buffer reused chunk after chunk. One
# [64, 151936] float64 CDF would be 78 MB of freshly faulted pages, ~3x slower on a 2-core CPU.
_CDF_CHUNK_BYTES = 6 << 20


def sampling_cdf(probs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The CDF that draw searches: running sums of probs [N, V] in float64 (rows independently).

    float32 is not enough: its running sum rounds each step to ~6e-8 of the mass so far, so the
    masses it implies are ~1e-3 (total variation) off on a 152k vocabulary, and a token below
    ~3e-8 after most of the mass adds nothing and can never be drawn. float64's ~1e-16 keeps
    every implied mass within float rounding of probs / probs.sum().
    """
    if out is None:
        out = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
    # Widen, then sum in place: faster on a CPU than cumsum(dtype=float64), which converts as it goes.
    return torch.cumsum(out.copy_(probs.detach()), -1, out=out)  # [N, V]: no gradient through sampling


def draw(
    probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of probs [N, V], by inverting the CDF with one uniform per row.

    Token i of a row is drawn with probability probs[i] / probs.sum() up to float64 rounding
    (~1e-16 per token): the distribution torch.multinomial draws from (tested against generate's
    sampler), at a fraction of its cost. multinomial draws an exponential variate for every
    vocabulary entry (about 40 ms per step for 32 rows x 49k tokens on a 2-core CPU); this draws
    one number per row and does a float64 cumsum and a binary search. Zero-probability tokens
    are never drawn: the search returns the first index whose cumulative mass exceeds u * total.

    u: optional uniforms in [0, 1), [N, 1] (else drawn from generator, float64).
    """
    N, V = probs.shape
    if u is None:
        u = torch.rand((N, 1), generator=generator, device=probs.device, dtype=torch.float64)
    rows = min(N, max(1, _CDF_CHUNK_BYTES // (8 * V))) if probs.device.type == "cpu" else N
    buf = torch.empty((rows, V), dtype=torch.float64, device=probs.device)
    tokens = []
    for p, uu in zip(probs.split(rows), u.split(rows)):  # [n, V], [n, 1]
        cdf = sampling_cdf(p, out=buf[: p.shape[0]])  # [n, V]
        total = cdf[:, -1:]  # [n, 1]
        # u < 1, but u * total may round up to total; the largest double below total keeps the
        # search inside the last token with mass (not a zero-probability token after it).
        x = torch.minimum(uu.to(cdf) * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens.append(torch.searchsorted(cdf, x, right=True))  # [n, 1]
    # The clamp only matters for an all-zero or NaN row (no valid token; multinomial would raise).
    return torch.cat(tokens).clamp_(max=V - 1).squeeze(-1)  # [N]


def _uniforms(seeds: list[int], columns: int, steps: int, device) -> torch.Tensor:
    """[steps, len(seeds) * columns]: seed b's `columns` uniforms per decode step (a CPU generator
    seeded seeds[b]; the same numbers whatever else shares the batch)."""
    return torch.cat(
        [
            torch.rand((steps, columns), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            for seed in seeds
        ],
        dim=1,
    ).to(device)


@dataclass
class _Decoded:
    tokens: torch.Tensor  # [N, C] pad_id after a row ended
    logps: torch.Tensor  # [N, C] 0 after a row ended
    mask: torch.Tensor  # [N, C] long: up to and including a row's last token (EOS, or the stop's)
    truncated: torch.Tensor  # [N] bool: neither EOS nor a stop string ended it


@dataclass
class _DecodeState:
    """A batch's KV cache between decode calls: the cache, its attention mask [N, L], the logits
    [N, V] that score each row's next token, and each row's last drawn token when it is not in
    the cache yet (pending [N], has_pending [N] bool)."""

    cache: object
    attention_mask: torch.Tensor
    logits: torch.Tensor
    pending: torch.Tensor
    has_pending: torch.Tensor


def _prefilled(model, prompts: list[list[int]], num_generations: int, pad_id: int):
    """Each prompt prefilled once into a KV cache that its G rows then share: (state, the rows'
    prompt ids and mask [N, P]). A model with recurrent or convolution layers (models.recurrent)
    prefills each prompt G times instead: the states its own cache keeps have no repeat."""
    device = next(model.parameters()).device
    G = num_generations
    if recurrent(model):
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(G)], pad_id, device)  # [N, P]
        cache, logits = prefill(model, prompt_ids, prompt_mask)  # [N, 1, V]
        logits = logits[:, -1, :]  # [N, V]
    else:
        unique_ids, unique_mask = left_pad(prompts, pad_id, device)  # [B, P]
        cache, logits = prefill(model, unique_ids, unique_mask)  # [B, 1, V]
        cache.batch_repeat_interleave(G)
        logits = logits[:, -1, :].repeat_interleave(G, dim=0)  # [N, V]
        prompt_ids = unique_ids.repeat_interleave(G, dim=0)  # [N, P]
        prompt_mask = unique_mask.repeat_interleave(G, dim=0)
    N = prompt_ids.shape[0]
    state = _DecodeState(
        cache,
        prompt_mask,
        logits,
        torch.full((N,), pad_id, dtype=torch.long, device=device),
        torch.zeros(N, dtype=torch.bool, device=device),
    )
    return state, prompt_ids, prompt_mask
