"""Scores from whole logits [B, T, V]: per-token log-probs, entropy, and the replay of the sampler's
top-k/top-p truncation (filter_logits, TokenScores.behaviour), row by row in fp32. The plain path
(trainer.logprob_chunk_size=0, or a model whose logits are not its output layer's) and the sampler's
filter. Imports nothing else of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then top-p (nucleus) truncation, in the order and with the tie rules of
    transformers' TopKLogitsWarper and TopPLogitsWarper. logits: [N, V] already tempered. The
    built-in sampler draws from softmax of these; the trainer replays them (token_scores) to score
    the distribution a sampler drew from."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)  # [N, V]
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least the most likely token
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    return logits


def truncates(top_k: int, top_p: float) -> bool:
    """Whether sampling with these settings draws from a truncated distribution."""
    return bool(top_k) or top_p < 1.0


def selective_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature).gather(targets) without materialising a [B, T, V] tensor
    (neither the log-probs nor the tempered logits): logit of the target minus the row's
    logsumexp, computed row by row in fp32."""
    return token_scores(logits, targets, temperature=temperature).logps


@dataclass(frozen=True)
class ScoringOptions:
    """How score_tokens scores completions (the settings of a scoring forward): the sampler's
    distribution (softmax(logits / temperature), top_k/top_p: its truncation, replayed for
    TokenScores.behaviour), whether to compute the entropy, whether a group's prompt runs once
    for its rows (shared_prompt: see forward._forward_logits) and the chunked path's tokens per
    chunk (chunk_size: None auto, 0 the model's whole logits; see chunked.chunk_tokens)."""

    temperature: float
    with_entropy: bool = False
    top_k: int = 0
    top_p: float = 1.0
    shared_prompt: bool = True
    chunk_size: int | None = None
    # The entropy with its gradient (loss.entropy_coef: the entropy bonus); implies with_entropy.
    entropy_grad: bool = False
    # Rows run in buckets of similar length (forward.length_buckets), and the chunked output layer
    # scores only the columns within each row's length (trainer.micro_batch_tokens turns it on).
    length_buckets: bool = False


class TokenScores(NamedTuple):
    logps: torch.Tensor  # [B, T] log softmax(logits / T) at the targets (the policy's; with gradient)
    # [B, T] entropy of softmax(logits / T); with its gradient where ScoringOptions.entropy_grad
    # (the entropy bonus), else none (monitoring).
    entropy: torch.Tensor | None
    # [B, T] the targets' log-probs under the sampler's distribution (top-k/top-p replayed on
    # softmax(logits / T): the distribution the samplers' contract records), no gradient; the same
    # values as logps when nothing truncates.
    behaviour: torch.Tensor


def token_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    entropy_grad: bool = False,
) -> TokenScores:
    """Per-token scores of targets [B, T] under softmax(logits / temperature) [B, T, V], row by row
    in fp32: the vocabulary-wide temporaries are one row's [T, V] (logits already tempered, as
    _forward_logits returns them: temperature=1, no copy at all in fp32). entropy_grad: the
    entropy keeps its gradient (implies with_entropy)."""
    with_entropy = with_entropy or entropy_grad
    logps, entropies, behaviour = [], [], []
    truncating = truncates(top_k, top_p)
    for row_logits, row_targets in zip(logits, targets):  # [T, V], [T]
        row = (row_logits if temperature == 1.0 else row_logits / temperature).float()  # [T, V]
        picked = row.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)  # [T]
        logps.append(picked - torch.logsumexp(row, dim=-1))
        if not (with_entropy or truncating):
            continue
        if entropy_grad:
            logp = F.log_softmax(row, dim=-1)  # [T, V]
            entropies.append(-(logp.exp() * logp).sum(-1))
        with torch.no_grad():
            row = row.detach()
            if with_entropy and not entropy_grad:
                logp = F.log_softmax(row, dim=-1)  # [T, V]
                entropies.append(-(logp.exp() * logp).sum(-1))
            if truncating:
                kept = filter_logits(row, top_k, top_p)  # [T, V]
                # The sampled token stays in (its own logit): a near-tie at the cut-off that the
                # sampler's rounding kept and the trainer's drops would otherwise score -inf.
                kept = kept.scatter(-1, row_targets.unsqueeze(-1), picked.detach().unsqueeze(-1))
                behaviour.append(picked.detach() - torch.logsumexp(kept, dim=-1))
    logps = torch.stack(logps)  # [B, T]
    return TokenScores(
        logps,
        torch.stack(entropies) if with_entropy else None,
        torch.stack(behaviour) if truncating else logps.detach(),
    )
