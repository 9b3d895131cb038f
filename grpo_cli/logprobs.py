"""Per-token log-probs of completion tokens: the one place the causal shift, padding and
temperature are handled (ref 000.2, 000.3, 000.4).

Two paths to the same numbers. Chunked (trainer.logprob_chunk_size: null, the default, or N > 0):
the forward stops at the final hidden states [B, C, H], and the output layer runs on chunks of
tokens, each chunk's logits [n, V] taken to log-probs and freed before the next, so no [B, C, V]
tensor is ever alive (_LinearHeadScores: its own backward, which keeps d log p / d hidden per
token). With logprob_chunk_size=0, the model's own logits [B, C, V].
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import NamedTuple

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


class TokenScores(NamedTuple):
    logps: torch.Tensor  # [B, T] log softmax(logits / T) at the targets (the policy's; with gradient)
    entropy: torch.Tensor | None  # [B, T] entropy of softmax(logits / T), no gradient (monitoring)
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
) -> TokenScores:
    """Per-token scores of targets [B, T] under softmax(logits / temperature) [B, T, V], row by row
    in fp32: the vocabulary-wide temporaries are one row's [T, V] (logits already tempered, as
    _forward_logits returns them: temperature=1, no copy at all in fp32)."""
    logps, entropies, behaviour = [], [], []
    truncating = truncates(top_k, top_p)
    for row_logits, row_targets in zip(logits, targets):  # [T, V], [T]
        row = (row_logits if temperature == 1.0 else row_logits / temperature).float()  # [T, V]
        picked = row.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)  # [T]
        logps.append(picked - torch.logsumexp(row, dim=-1))
        if not (with_entropy or truncating):
            continue
        with torch.no_grad():
            row = row.detach()
            if with_entropy:
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


#: logprob_chunk_size=None (auto): tokens per chunk such that one chunk's fp32 logits are about
#: this many bytes (SmolLM2's 49,152-token vocabulary: 341 tokens; Qwen2.5's 151,936: 110).
AUTO_CHUNK_BYTES = 64 * 2**20


def chunk_tokens(chunk_size: int | None, vocab_size: int) -> int:
    """Tokens per chunk: chunk_size, or for None (auto) AUTO_CHUNK_BYTES of fp32 logits."""
    return chunk_size if chunk_size else max(16, AUTO_CHUNK_BYTES // (4 * vocab_size))


class _HiddenOut(torch.nn.Module):
    """Stands in for the output layer during a chunked forward: the final hidden states pass
    through (the model returns them where it returned logits)."""

    def forward(self, hidden):
        return hidden


class OutputLayer(NamedTuple):
    """What turns final hidden states into logits: the output layer (a LoRA-wrapped one as it
    is) and the model's logit soft-capping (Gemma2's final_logit_softcapping; None: none)."""

    head: torch.nn.Module
    softcap: float | None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _softcap_config(model):
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text if getattr(text, "final_logit_softcapping", None) else config


@contextlib.contextmanager
def hidden_states_out(model):
    """Within the block the model's forward returns its final hidden states where it returned
    logits (its output layer replaced by _HiddenOut, its soft-capping off); yields the
    OutputLayer that makes them logits. Restored on exit, however the block ends."""
    m = forward_model(model)
    head = m.get_output_embeddings()
    config = _softcap_config(m)
    softcap = getattr(config, "final_logit_softcapping", None)
    m.set_output_embeddings(_HiddenOut())
    if softcap:
        config.final_logit_softcapping = None
    try:
        yield OutputLayer(head, softcap)
    finally:
        m.set_output_embeddings(head)
        if softcap:
            config.final_logit_softcapping = softcap


_CHUNKABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> chunkable


def chunkable(model) -> bool:
    """Whether the chunked path gives this model's logits: checked once per model on a short
    input, the model's own logits against OutputLayer.logits of its hidden states (an
    architecture that scales or biases its logits some other way keeps the plain path). Under
    FSDP2 the output layer belongs to the root module, whose weights stay gathered from its
    forward to its backward (FSDP2 does not reshard the root after forward): the chunks use them
    there, and the gradient reaches them, to be reduce-scattered with the root's others."""
    key = forward_model(model)
    if key not in _CHUNKABLE:
        m = forward_model(model)
        head = m.get_output_embeddings()
        ok = isinstance(getattr(head, "weight", None), torch.Tensor)
        if ok:
            ids = torch.tensor([[1, 2, 3]], device=head.weight.device)
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            with torch.no_grad():
                plain = model_logits(model, **kw).float()
                with hidden_states_out(model) as out:
                    hidden = model_logits(model, **kw)
                    ok = not _sharded(out.head)
                    chunked = out.logits(hidden).float() if ok else None
            ok = ok and plain.shape == chunked.shape and torch.allclose(plain, chunked, rtol=1e-3, atol=1e-3)
        _CHUNKABLE[key] = ok
    return _CHUNKABLE[key]


def _sharded(module) -> bool:
    """Whether a module's weights are shards right now (FSDP2's DTensors outside its forward)."""
    return any(hasattr(p, "to_local") for p in module.parameters())


def _chunk_scores(out: OutputLayer, hidden, targets, temperature, with_entropy, top_k, top_p):
    """One chunk: hidden [n, H], targets [n] -> (logps [n], entropy [n] or None, behaviour [n]).
    Its logits [n, V] live only inside (recomputed in the backward: chunked_scores)."""
    logits = out.logits(hidden).float()  # [n, V]
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]
    logps = picked - torch.logsumexp(logits, dim=-1)
    entropy = behaviour = None
    with torch.no_grad():
        row = logits.detach()
        if with_entropy:
            logp = F.log_softmax(row, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
        if truncates(top_k, top_p):
            kept = filter_logits(row, top_k, top_p)
            kept = kept.scatter(-1, targets.unsqueeze(-1), picked.detach().unsqueeze(-1))
            behaviour = picked.detach() - torch.logsumexp(kept, dim=-1)
    return logps, entropy, behaviour


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's matmuls run in: autocast's where it is on (as an autocast
    F.linear would), else the weight's own; fp32 for bf16/fp16 on a CPU without bf16 units, where
    oneDNN's fallback takes 4-350x fp32's time on these shapes."""
    kind = weight.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    if kind == "cpu" and dtype in (torch.bfloat16, torch.float16):
        from grpo_cli.precision import cpu_has_bf16

        if not cpu_has_bf16():  # no bf16 units: a [n, V] @ [V, H] product took 350x fp32's time
            return torch.float32
    return dtype


def _linear_logits(hidden, weight, bias, softcap):
    """One chunk's logits [n, V] in fp32 from hidden [n, H] (already in the compute dtype), and
    the soft-capping's tanh [n, V] (None without soft-capping) for its derivative."""
    logits = F.linear(hidden, weight, bias).float()  # [n, V]
    if not softcap:
        return logits, None
    capped = logits.div_(softcap).tanh_()  # [n, V]
    return capped * softcap, capped


def _chunk_stats(logits, targets, with_entropy, top_k, top_p):
    """logits [n, V] fp32, already tempered (overwritten: shifted by their row max) -> (logps [n],
    entropy [n] or None, behaviour [n] or None, lse [n], probs [n, V]): one max, one exp and one
    sum over the vocabulary per row, where log_softmax, softmax and logsumexp would each pay their
    own passes (and their backward more)."""
    top = logits.max(-1, keepdim=True).values  # [n, 1]
    shifted = logits.sub_(top)  # [n, V], <= 0
    picked = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]
    exps = shifted.exp()  # [n, V]
    total = exps.sum(-1)  # [n]
    log_total = total.log()
    logps = picked - log_total
    entropy = behaviour = None
    if with_entropy:  # H = log Z - sum(p * z), with z the shifted logits
        entropy = log_total - torch.linalg.vecdot(exps, shifted) / total
    if truncates(top_k, top_p):
        kept = filter_logits(shifted, top_k, top_p)
        kept = kept.scatter(-1, targets.unsqueeze(-1), picked.unsqueeze(-1))
        behaviour = picked - torch.logsumexp(kept, dim=-1)
    probs = exps.div_(total.unsqueeze(-1))  # [n, V]
    return logps, entropy, behaviour, top.squeeze(-1) + log_total, probs


def _logit_grad(probs, targets, scale, temperature, capped, start=0):
    """d log p(target) / d (output layer's logits) [n, V], times scale [n] (None: 1); overwrites
    probs and capped: (onehot - p) / temperature, through the soft-capping's tanh if any. probs
    may be the vocabulary's columns start.. only (a target outside them gets no onehot)."""
    grad = probs.neg_()
    local = targets - start
    inside = (local >= 0) & (local < grad.shape[1])  # [n]
    grad.scatter_add_(
        -1, local.clamp(0, grad.shape[1] - 1).unsqueeze(-1), inside.to(grad.dtype).unsqueeze(-1)
    )
    if scale is not None:
        grad.mul_(scale.unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    if capped is not None:
        grad.mul_(capped.square_().neg_().add_(1))
    return grad


def _head_pass(h, w, b, targets, *, temperature, softcap, chunk, with_entropy, top_k, top_p, dhidden):
    """The chunk loop of _LinearHeadScores.forward (no autograd): hidden h [N, H] and output layer
    (w, b) already in the compute dtype -> (logps, entropy, behaviour, lse) [N] each, and, when
    dhidden [N, H] is given, d log p / d hidden written into it."""
    N = h.shape[0]
    new = lambda: torch.empty(N, device=h.device)  # noqa: E731
    logps, lses = new(), new()
    entropy = new() if with_entropy else None
    behaviour = new() if truncates(top_k, top_p) else None
    for start in range(0, N, chunk):
        part = slice(start, start + chunk)
        logits, capped = _linear_logits(h[part], w, b, softcap)  # [n, V]
        if temperature != 1.0:
            logits.div_(temperature)
        lp, ent, beh, lse, probs = _chunk_stats(logits, targets[part], with_entropy, top_k, top_p)
        del logits
        logps[part], lses[part] = lp, lse
        if entropy is not None:
            entropy[part] = ent
        if behaviour is not None:
            behaviour[part] = beh
        if dhidden is not None:
            dlogits = _logit_grad(probs, targets[part], None, temperature, capped)  # [n, V]
            dhidden[part] = dlogits.to(w.dtype) @ w  # [n, H]
        del probs, capped
    return logps, entropy, behaviour, lses


def _head_scores(
    hidden, weight, bias, targets, temperature, softcap, chunk, with_entropy, top_k, top_p, *, with_dhidden
):
    """hidden [N, H], the output layer (weight, bias) cast to the compute dtype (autocast off
    inside: the dtypes are set here), and _head_pass on them: ((h, w, b, dhidden), (logps,
    entropy, behaviour, lse)); dhidden [N, H] (d log p / d hidden) only when with_dhidden."""
    dtype = _compute_dtype(weight)
    with torch.autocast(weight.device.type, enabled=False):
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        h = hidden.to(dtype)
        dhidden = torch.empty(h.shape, device=h.device, dtype=dtype) if with_dhidden else None
        scores = _head_pass(
            h,
            w,
            b,
            targets,
            temperature=temperature,
            softcap=softcap,
            chunk=chunk,
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
            dhidden=dhidden,
        )
    return (h, w, b, dhidden), scores


def _head_weight_grad(h, w, b, targets, lses, dlogps, temperature, softcap, chunk, weight_dtype):
    """The output layer's gradient (weight [V, H], bias [V] or None) in weight_dtype, from hidden
    h [N, H] and (w, b) in the compute dtype, the forward's logsumexps lses [N] and the upstream
    dlogps [N]. Sliced by vocabulary rows, not by tokens: each slice recomputes its logits for all
    N tokens ([N, v], as many elements as a token chunk's [chunk, V]) and writes its rows of the
    gradient with one matmul over all tokens. A token-chunked loop would add a whole [V, H]
    partial gradient per chunk (a bf16 temporary and an fp32 read-modify-write of V * H each
    time); this writes each row once, and sums the tokens inside the matmul (fp32 accumulation,
    one rounding to the compute dtype, as autograd's own matmul would)."""
    N, V = h.shape[0], w.shape[0]
    rows = V if N <= chunk else max(1, chunk * V // N)  # vocabulary rows per slice: [N, rows] <= [chunk, V]
    grad_weight = torch.empty(w.shape, device=w.device, dtype=weight_dtype)  # [V, H]
    grad_bias = None if b is None else torch.empty(b.shape, device=w.device, dtype=weight_dtype)
    with torch.autocast(w.device.type, enabled=False):
        for start in range(0, V, rows):
            part = slice(start, start + rows)
            logits, capped = _linear_logits(h, w[part], None if b is None else b[part], softcap)  # [N, v]
            if temperature != 1.0:
                logits.div_(temperature)
            probs = logits.sub_(lses.unsqueeze(-1)).exp_()  # [N, v]
            dlogits = _logit_grad(probs, targets, dlogps, temperature, capped, start)  # [N, v]
            if w.dtype == grad_weight.dtype:
                torch.mm(dlogits.to(w.dtype).t(), h, out=grad_weight[part])
            else:  # a bf16/fp16 matmul, as autograd's would be
                grad_weight[part] = dlogits.to(w.dtype).t() @ h
            if grad_bias is not None:
                grad_bias[part] = dlogits.sum(0)
            del logits, probs, dlogits, capped
    return grad_weight, grad_bias


class _LinearHeadScores(torch.autograd.Function):
    """TokenScores from final hidden states [N, H] through a plain linear output layer, chunk by
    chunk, with a hand-written backward. The forward keeps, per token, d log p / d hidden (=
    (onehot - p) W / T, [N, H]: the size of the hidden states) and the row's logsumexp, so the
    gradient to the hidden states costs no recompute; only a trained output layer's own gradient
    recomputes the logits in the backward (_head_weight_grad: a slice of the vocabulary for every
    token at a time, as many elements as a chunk). No [n, V] tensor outlives its chunk.
    Entropy and behaviour log-probs carry no gradient (monitoring and the sampler's contract)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk, with_entropy, top_k, top_p):
        train_head = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        args = (temperature, softcap, chunk, with_entropy, top_k, top_p)
        (h, w, b, dhidden), (logps, entropy, behaviour, lses) = _head_scores(
            hidden, weight, bias, targets, *args, with_dhidden=ctx.needs_input_grad[0]
        )
        if train_head:
            ctx.save_for_backward(dhidden, h, w, b, targets, lses)
        else:
            ctx.save_for_backward(dhidden)
        ctx.args = (temperature, softcap, chunk, hidden.dtype, weight.dtype, train_head)
        ctx.mark_non_differentiable(*(t for t in (entropy, behaviour) if t is not None))
        return logps, entropy, behaviour

    @staticmethod
    def backward(ctx, dlogps, _dentropy, _dbehaviour):
        temperature, softcap, chunk, hidden_dtype, weight_dtype, train_head = ctx.args
        dhidden, *rest = ctx.saved_tensors
        dlogps = dlogps.float()  # [N]
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (dhidden.float() * dlogps.unsqueeze(-1)).to(hidden_dtype)  # [N, H]
        if train_head:
            h, w, b, targets, lses = rest
            grad_weight, grad_bias = _head_weight_grad(
                h, w, b, targets, lses, dlogps, temperature, softcap, chunk, weight_dtype
            )
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _plain_linear(head) -> bool:
    """A torch Linear as it is (no LoRA wrapper, no hooks): _LinearHeadScores' own backward can
    stand in for it."""
    return (
        isinstance(head, torch.nn.Linear)
        and type(head).forward is torch.nn.Linear.forward
        and not (head._forward_hooks or head._forward_pre_hooks or head._backward_hooks)
    )


def chunked_scores(
    out: OutputLayer,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> TokenScores:
    """TokenScores of targets [B, T] from final hidden states [B, T, H], `chunk` tokens at a time:
    the same numbers as token_scores on the whole logits, with at most one chunk's [chunk, V]
    logits alive. A plain linear output layer runs _LinearHeadScores (its own backward); any other
    (a LoRA-wrapped one) runs its chunks under torch.utils.checkpoint, which recomputes a chunk's
    forward in the backward."""
    from torch.utils.checkpoint import checkpoint

    B, T, H = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(B * T, H), targets.reshape(B * T)
    truncating = truncates(top_k, top_p)
    if _plain_linear(out.head):
        head = out.head
        args = (temperature, out.softcap, chunk, with_entropy, top_k, top_p)
        if torch.is_grad_enabled():
            logps, entropy, behaviour = _LinearHeadScores.apply(
                flat_hidden, head.weight, head.bias, flat_targets, *args
            )
        else:  # (the reference pass, evaluation: nothing kept for a backward)
            _, (logps, entropy, behaviour, _) = _head_scores(
                flat_hidden, head.weight, head.bias, flat_targets, *args, with_dhidden=False
            )
        view = lambda t: None if t is None else t.view(B, T)  # noqa: E731
        logps = logps.view(B, T)
        return TokenScores(logps, view(entropy), view(behaviour) if truncating else logps.detach())
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logps, entropies, behaviours = [], [], []
    for start in range(0, B * T, chunk):
        args = (out, flat_hidden[start : start + chunk], flat_targets[start : start + chunk])
        rest = (temperature, with_entropy, top_k, top_p)
        if grad:
            lp, ent, beh = checkpoint(_chunk_scores, *args, *rest, use_reentrant=False)
        else:
            lp, ent, beh = _chunk_scores(*args, *rest)
        logps.append(lp)
        entropies.append(ent)
        behaviours.append(beh)
    logps = torch.cat(logps).view(B, T)
    return TokenScores(
        logps,
        torch.cat(entropies).view(B, T) if with_entropy else None,
        torch.cat(behaviours).view(B, T) if truncating else logps.detach(),
    )


def padding_bounds(prompt_mask: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, int]:
    """(first prompt column holding a real token in some row, completion columns up to the last
    attended one of any row): the columns outside are padding in every row, no work to spend on.
    (A completion's attended tokens need not be a contiguous prefix.)"""
    first = int(prompt_mask.any(0).long().argmax())
    attended = attention_mask.bool().any(0)  # [C]
    used = int(attended.nonzero().max()) + 1 if bool(attended.any()) else 1
    return first, used


def _forward_logits(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    attention_mask,
    num_generations: int = 1,
    shared_prompt: bool = True,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(Within hidden_states_out: the final hidden states [B, C, H] at those positions, and the
    temperature is the caller's.) Logits [B, C, V] that score the C completion tokens, divided by the temperature (ref
    000.4): logits at position t score token t+1 (ref 000.2), so they are the ones from the last
    prompt position to the second-to-last completion position; only those are materialised.
    attention_mask [B, C]: the completion-side tokens the model sees (rollout.Rollout: it may have
    holes). The temperature divides the fresh logits in place: no second [B, C, V] tensor. (In
    place is safe here: the output layer's backward and a soft-capping's final scaling keep no
    copy of their output; an architecture whose last op did would make autograd raise, not
    compute a wrong gradient.)

    The rows come in groups of num_generations (G) consecutive rows that share one prompt (a
    rollout's contract); with G > 1 each prompt is run once and its KV cache is shared by its G
    completions (gradients flow back into the prompt's pass through the cache). Same numbers as
    running every [prompt, completion] row in full, up to float rounding (tested), at a fraction
    of the cost: prompts are often most of the tokens. shared_prompt=False always runs the plain
    full rows (for an architecture not tested here).
    """
    B, C = completion_ids.shape
    G = num_generations if shared_prompt else 1
    if B % G:
        raise ValueError(f"_forward_logits: {B} rows are not groups of num_generations={G}")
    use_cache = G > 1 and not checkpointing(model)
    if not use_cache:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+C]
        mask = torch.cat([prompt_mask, attention_mask], dim=1).long()  # [B, P+C]
        logits = model_logits(
            model,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            logits_to_keep=C + 1,
            use_cache=False,
        )  # [B, C+1, V]
        return _tempered(
            logits[:, :-1, :], temperature
        )  # [B, C, V]: logits[:, i] predicts completion token i
    cache, first = prefill(model, prompt_ids[::G], prompt_mask[::G].long())  # [B/G, 1, V]
    first_logits = first.repeat_interleave(G, dim=0)  # [B, 1, V]: scores completion token 0
    if C == 1:
        return _tempered(first_logits, temperature)
    cache.batch_repeat_interleave(G)  # [B/G, ...] -> [B, ...], differentiable
    mask = torch.cat([prompt_mask, attention_mask[:, :-1]], dim=1).long()  # [B, P+C-1]
    rest = model_logits(
        model,
        input_ids=completion_ids[:, :-1],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask)[:, prompt_ids.shape[1] :],
        past_key_values=cache,
        use_cache=True,
    )  # [B, C-1, V]
    return _tempered(torch.cat([first_logits, rest], dim=1), temperature)  # [B, C, V]


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, in place (the same values and gradient as out of place)."""
    return logits if temperature == 1.0 else logits.div_(temperature)


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
