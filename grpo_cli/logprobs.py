"""Per-token log-probs of completion tokens: the one place the causal shift, padding and
temperature are handled (ref 000.2, 000.3, 000.4).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left padding shifts where real tokens start; positions count real tokens only (ref 000.3)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]


def forward_model(model):
    """The transformers model that runs the forward: a PEFT model's wrapped model (its LoRA layers
    are injected in place, so the adapters run), whose own signature decides the keywords below."""
    from grpo_cli.adapters import is_adapted

    return model.get_base_model() if is_adapted(model) else model


def model_logits(model, *, logits_to_keep: int | None = None, **kwargs) -> torch.Tensor:
    """model(**kwargs).logits, made uniform across architectures (every forward pass here and in
    the sampler goes through it):

    - logits_to_keep=k: the last k positions, [B, k, V]. OPT, GPT-Neo, GPT-J, CodeGen,
      GPTBigCode, ... (transformers 4.57) swallow the keyword in **kwargs and return every
      position; the extra ones are cut here.
    - keywords the forward does not take are dropped (Bart-style decoders have neither
      position_ids nor logits_to_keep, nor **kwargs): such a model computes its own positions.
    """
    model = forward_model(model)
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    params = inspect.signature(model.forward).parameters
    if "past_key_values" in kwargs and "cache" in params and "past_key_values" not in params:
        kwargs["cache"] = kwargs.pop(
            "past_key_values"
        )  # its name since transformers 5.2x (the old one warns)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    logits = model(**kwargs).logits  # [B, L, V], or [B, k, V] when the model honours logits_to_keep
    if logits_to_keep is not None and logits.shape[1] > logits_to_keep:
        logits = logits[:, -logits_to_keep:]  # [B, k, V]
    return logits


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Run each (left-padded) prompt [B, P] once into a fresh KV cache: (the cache, the logits
    [B, 1, V] of the last position, which score the first completion token). The training forward
    and the sampler share prompts this way."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model_logits(
        model,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids_from_mask(prompt_mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )  # [B, 1, V]
    return cache, logits


def checkpointing(model) -> bool:
    """Whether gradient (activation) checkpointing is on: transformers 5 renamed the attribute
    and warns on the old name."""
    model = forward_model(model)
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def selective_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits).gather(targets) without materialising the [B, T, V] log-prob tensor:
    logit of the target minus the row's logsumexp, computed row by row in fp32."""
    out = []
    for row_logits, row_targets in zip(logits, targets):  # [T, V], [T]
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)  # [T]
        out.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(out)  # [B, T]


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, row by row (monitoring only, no gradient)."""
    out = []
    for row in logits:  # [T, V]
        logp = F.log_softmax(row.float(), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(out)  # [B, T]


def padding_bounds(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[int, int]:
    """(first prompt column holding a real token in some row, completion columns up to the
    longest completion): the columns outside are padding in every row, no work to spend on."""
    first = int(prompt_mask.any(0).long().argmax())
    used = int(completion_mask.sum(-1).max().clamp(min=1))
    return first, used


def shared_prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """G when the rows come in runs of G identical prompts (a GRPO batch: G completions per
    prompt, one group's rows consecutive), else 1."""
    n = prompt_ids.shape[0]
    first = torch.nonzero((prompt_ids != prompt_ids[:1]).any(-1) | (prompt_mask != prompt_mask[:1]).any(-1))
    G = int(first[0]) if first.numel() else n  # length of the first run
    if G <= 1 or n % G:
        return 1
    same = (prompt_ids.view(n // G, G, -1) == prompt_ids[::G, None]).all() and (
        prompt_mask.view(n // G, G, -1) == prompt_mask[::G, None]
    ).all()
    return G if bool(same) else 1


def _forward_logits(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, shared_prompt: bool = True
) -> torch.Tensor:
    """Logits [B, C, V] that score the C completion tokens: logits at position t score token
    t+1 (ref 000.2), so they are the ones from the last prompt position to the second-to-last
    completion position; only those are materialised.

    When the rows come in groups of G identical prompts, each prompt is run once and its KV
    cache is shared by its G completions (gradients flow back into the prompt's pass through
    the cache). Same numbers as running every [prompt, completion] row in full, up to float
    rounding (tested), at a fraction of the cost: prompts are often most of the tokens.
    shared_prompt=False always runs the plain full rows (for an architecture not tested here).
    """
    C = completion_ids.shape[1]
    G = shared_prompt_groups(prompt_ids, prompt_mask) if shared_prompt else 1
    use_cache = G > 1 and not checkpointing(model)
    if not use_cache:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+C]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()  # [B, P+C]
        logits = model_logits(
            model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            logits_to_keep=C + 1,
            use_cache=False,
        )  # [B, C+1, V]
        return logits[:, :-1, :]  # [B, C, V]: logits[:, i] predicts completion token i
    cache, first = prefill(model, prompt_ids[::G], prompt_mask[::G].long())  # [B/G, 1, V]
    first_logits = first.repeat_interleave(G, dim=0)  # [B, 1, V]: scores completion token 0
    if C == 1:
        return first_logits
    cache.batch_repeat_interleave(G)  # [B/G, ...] -> [B, ...], differentiable
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1).long()  # [B, P+C-1]
    rest = model_logits(
        model,
        input_ids=completion_ids[:, :-1],
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, prompt_ids.shape[1] :],
        past_key_values=cache,
        use_cache=True,
    )  # [B, C-1, V]
    return torch.cat([first_logits, rest], dim=1)  # [B, C, V]


def token_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    shared_prompt: bool = True,
):
    """Log-probs of each completion token under softmax(logits / temperature).

    prompt_ids/prompt_mask [B, P] are left-padded; completion_ids/completion_mask [B, C] are
    right-padded (mask 1 up to and including EOS). Returns logps [B, C] (and entropy [B, C]).
    shared_prompt: run a group's prompt once and share its KV cache (see _forward_logits).
    """
    logits = _forward_logits(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, shared_prompt
    )  # [B, C, V]
    # Same tempered distribution the sampler drew from (ref 000.4).
    logits = logits / temperature
    logps = selective_logprobs(logits, completion_ids)  # [B, C]
    if with_entropy:
        return logps, entropy_from_logits(logits.detach())
    return logps


class TokenLogprobs(torch.nn.Module):
    """token_logprobs(model, ...) with entropy, as a module's forward: what the training step runs.
    A module so that DistributedDataParallel can wrap it: DDP's forward arms the gradient
    all-reduce that the backward then runs (distributed.wrap_scorer); one process runs it as is."""

    def __init__(self, model, *, temperature: float, shared_prompt: bool):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.shared_prompt = shared_prompt

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return token_logprobs(
            self.model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature=self.temperature,
            with_entropy=True,
            shared_prompt=self.shared_prompt,
        )  # ([b, C], [b, C])
