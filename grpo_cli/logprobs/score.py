"""The entry points: score_tokens (the chunked path where the model allows it, else the whole
logits), token_logprobs, and TokenLogprobs, the module the training step runs. Imports forward,
whole and chunked.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grpo_cli.logprobs.chunked import _sharded, chunk_tokens, chunkable, chunked_scores, hidden_states_out
from grpo_cli.logprobs.forward import _forward_logits, length_buckets, row_lengths
from grpo_cli.logprobs.whole import ScoringOptions, TokenScores, token_scores, truncates


def score_tokens(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    options: ScoringOptions,
    num_generations: int = 1,
) -> TokenScores:
    """TokenScores of the completion tokens under `options` (ScoringOptions): the chunked path
    (options.chunk_size tokens at a time; None: auto, chunk_tokens) where the model's logits are
    its output layer's (chunkable), else, and with chunk_size=0, the model's own logits [B, C, V]
    (_forward_logits).

    prompt_ids/prompt_mask [B, P] are left-padded; completion_ids/attention_mask [B, C] are
    right-padded (rollout.Rollout). num_generations: the rows' group size (one prompt per G
    consecutive rows), whose prompt runs once under options.shared_prompt, where every group's
    rows do share one prompt (an environment whose resets differ within a group gives its
    episodes prompts of their own: those rows then run whole)."""
    group_size = (
        num_generations if options.shared_prompt and groups_share_prompts(prompt_ids, num_generations) else 1
    )
    args = (model, prompt_ids, prompt_mask, completion_ids, attention_mask, group_size)
    lengths = row_lengths(attention_mask) if options.length_buckets else None
    buckets = length_buckets(lengths) if options.length_buckets else None
    if options.chunk_size != 0 and chunkable(model):
        with hidden_states_out(model) as out:
            hidden = _forward_logits(*args, 1.0, buckets)  # [B, C, H]
        if _sharded(out.head):  # (FSDP2 resharded its root after all: the whole logits, once more)
            return score_tokens(*args[:5], replace(options, chunk_size=0), num_generations)
        chunk = chunk_tokens(options.chunk_size, out.head.weight.shape[0])
        # (Scoring only the real columns gathers them into a tensor of their own: worth it where
        # padding is over a fifth of the columns; below, measured, the gather raised the default
        # recipe's peak by 4% and saved no time.)
        if lengths is None or sum(lengths) > 0.8 * completion_ids.numel():
            return chunked_scores(out, hidden, completion_ids, options, chunk=chunk)
        return _within_lengths(out, hidden, completion_ids, lengths, options, chunk)
    logits = _forward_logits(*args, options.temperature, buckets)  # [B, C, V], tempered
    o = options
    return token_scores(
        logits,
        completion_ids,
        temperature=1.0,
        with_entropy=o.with_entropy,
        top_k=o.top_k,
        top_p=o.top_p,
        entropy_grad=o.entropy_grad,
    )


def _within_lengths(
    out, hidden, completion_ids, lengths: list[int], options: ScoringOptions, chunk: int
) -> TokenScores:
    """chunked_scores of the columns within each row's length only (the output layer's work in
    proportion to real tokens), the others zeros: hidden [B, C, H] -> TokenScores [B, C]."""
    B, C, H = hidden.shape
    inside = torch.arange(C, device=hidden.device) < torch.tensor(lengths, device=hidden.device).unsqueeze(
        1
    )  # [B, C]
    at = inside.view(-1).nonzero().squeeze(1)  # [K]: the flat positions scored
    s = chunked_scores(
        out,
        hidden.reshape(B * C, H)[at].unsqueeze(0),
        completion_ids.reshape(-1)[at].unsqueeze(0),
        options,
        chunk=chunk,
    )

    def spread(t):  # [1, K] -> [B, C], zeros outside (differentiable in t)
        return None if t is None else t.new_zeros(B * C).index_put((at,), t[0]).view(B, C)

    logps = spread(s.logps)
    return TokenScores(
        logps,
        spread(s.entropy),
        spread(s.behaviour) if truncates(options.top_k, options.top_p) else logps.detach(),
    )


def token_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    num_generations: int = 1,
) -> torch.Tensor:
    """Log-probs [B, C] of each completion token under softmax(logits / temperature), the
    distribution the sampler drew from before any truncation (ref 000.4): score_tokens with the
    default ScoringOptions (a group's prompt shared, the chunked path where the model allows it).
    Positions outside the caller's trained-token mask hold values no one should read. For the
    entropy or other options, call score_tokens."""
    options = ScoringOptions(temperature)
    return score_tokens(
        model, prompt_ids, prompt_mask, completion_ids, attention_mask, options, num_generations
    ).logps


class TokenLogprobs(torch.nn.Module):
    """What the training step runs on a micro-batch: the policy's log-probs, their entropy, and
    the log-probs under the sampler's own (truncated) distribution (TokenScores), as a module's
    forward. A module so that DistributedDataParallel can wrap it: DDP's forward arms the gradient
    all-reduce that the backward then runs (distributed.wrap_scorer); one process runs it as is."""

    def __init__(
        self,
        model,
        *,
        temperature: float,
        shared_prompt: bool,
        top_k: int = 0,
        top_p: float = 1.0,
        chunk_size: int | None = None,
        entropy_grad: bool = False,
        length_buckets: bool = False,
    ):
        super().__init__()
        self.model = model
        self.options = ScoringOptions(
            temperature,
            with_entropy=True,
            top_k=top_k,
            top_p=top_p,
            shared_prompt=shared_prompt,
            chunk_size=chunk_size,
            entropy_grad=entropy_grad,
            length_buckets=length_buckets,
        )

    def forward(
        self, prompt_ids, prompt_mask, completion_ids, attention_mask, num_generations: int = 1, options=None
    ):
        """TokenScores [b, C] each; `options`: a ScoringOptions of the caller's instead of the
        training step's (the warm-up's NLL: temperature 1, no truncation; grpo_cli/sft.py)."""
        return score_tokens(
            self.model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            attention_mask,
            options or self.options,
            num_generations,
        )


def shared_prompt_groups(prompt_ids: torch.Tensor, G: int) -> list[bool]:
    """Per group of G consecutive rows of prompt_ids [B, P]: whether its rows hold one prompt (the
    left-padded ids equal: the masks then are too). The one test of it: the scorer (whether a
    micro-batch's prompts run once) and the packer (what a group costs) read it."""
    B, P = prompt_ids.shape
    return (prompt_ids.view(B // G, G, P) == prompt_ids[::G].unsqueeze(1)).all(-1).all(-1).tolist()


def groups_share_prompts(prompt_ids: torch.Tensor, G: int) -> bool:
    """Whether every group of G consecutive rows of prompt_ids [B, P] holds one prompt."""
    B, _ = prompt_ids.shape
    if G <= 1 or B % G:
        return True  # (rows that are not whole groups: _forward_logits refuses them)
    return all(shared_prompt_groups(prompt_ids, G))
