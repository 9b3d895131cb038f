"""The entry points: score_tokens (the chunked path where the model allows it, else the whole
logits), token_logprobs, and TokenLogprobs, the module the training step runs. Imports forward,
whole and chunked.
"""

from __future__ import annotations

import torch

from grpo_cli.logprobs.chunked import _sharded, chunk_tokens, chunkable, chunked_scores, hidden_states_out
from grpo_cli.logprobs.forward import _forward_logits
from grpo_cli.logprobs.whole import TokenScores, token_scores


def score_tokens(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    num_generations: int = 1,
    shared_prompt: bool = True,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int | None = None,
) -> TokenScores:
    """TokenScores of the completion tokens: the chunked path (chunk_size tokens at a time; None:
    auto, chunk_tokens) where the model's logits are its output layer's (chunkable), else, and
    with chunk_size=0, the model's own logits [B, C, V] (_forward_logits)."""
    args = (model, prompt_ids, prompt_mask, completion_ids, attention_mask, num_generations, shared_prompt)
    if chunk_size != 0 and chunkable(model):
        with hidden_states_out(model) as out:
            hidden = _forward_logits(*args, 1.0)  # [B, C, H]
        if _sharded(out.head):  # (FSDP2 resharded its root after all: the whole logits, once more)
            return score_tokens(
                *args[:5],
                temperature=temperature,
                num_generations=num_generations,
                shared_prompt=shared_prompt,
                with_entropy=with_entropy,
                top_k=top_k,
                top_p=top_p,
                chunk_size=0,
            )
        vocab = out.head.weight.shape[0]
        return chunked_scores(
            out,
            hidden,
            completion_ids,
            temperature=temperature,
            chunk=chunk_tokens(chunk_size, vocab),
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
        )
    logits = _forward_logits(*args, temperature)  # [B, C, V], tempered
    return token_scores(
        logits, completion_ids, temperature=1.0, with_entropy=with_entropy, top_k=top_k, top_p=top_p
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
    with_entropy: bool = False,
    shared_prompt: bool = True,
    chunk_size: int | None = None,
):
    """Log-probs of each completion token under softmax(logits / temperature), the distribution
    the sampler drew from before any truncation (ref 000.4).

    prompt_ids/prompt_mask [B, P] are left-padded; completion_ids/attention_mask [B, C] are
    right-padded (rollout.Rollout). Returns logps [B, C] (and entropy [B, C]); positions outside
    the caller's trained-token mask hold values no one should read.
    num_generations: the rows' group size (one prompt per G consecutive rows); shared_prompt: run
    a group's prompt once and share its KV cache (see _forward_logits); chunk_size: score_tokens.
    """
    scores = score_tokens(
        model,
        prompt_ids,
        prompt_mask,
        completion_ids,
        attention_mask,
        temperature=temperature,
        num_generations=num_generations,
        shared_prompt=shared_prompt,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )
    return (scores.logps, scores.entropy) if with_entropy else scores.logps


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
    ):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.shared_prompt = shared_prompt
        self.top_k, self.top_p = top_k, top_p
        self.chunk_size = chunk_size

    def forward(self, prompt_ids, prompt_mask, completion_ids, attention_mask, num_generations: int = 1):
        return score_tokens(
            self.model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            attention_mask,
            temperature=self.temperature,
            num_generations=num_generations,
            shared_prompt=self.shared_prompt,
            with_entropy=True,
            top_k=self.top_k,
            top_p=self.top_p,
            chunk_size=self.chunk_size,
        )  # TokenScores: [b, C] each
