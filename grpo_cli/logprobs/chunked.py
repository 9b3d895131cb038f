"""The chunked path (trainer.logprob_chunk_size: null, the default, or N > 0): the forward stops at
the final hidden states [B, C, H] (hidden_states_out), and the output layer runs on chunks of tokens,
each chunk's logits [n, V] taken to log-probs and freed before the next, so no [B, C, V] tensor is
ever alive (_LinearHeadScores: its own backward, which keeps d log p / d hidden per token; any other
output layer under torch.utils.checkpoint). The same numbers as whole.token_scores on the whole
logits. Imports forward and whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpo_cli.logprobs.forward import forward_model, model_logits
from grpo_cli.logprobs.whole import ScoringOptions, TokenScores, filter_logits, truncates

#: logprob_chunk_size=None (auto): tokens per chunk such that one chunk's fp32 logits are about
#: this many bytes (SmolLM2's 49,152-token vocabulary: 341 tokens; Qwen2.5's 151,936: 110).
AUTO_CHUNK_BYTES = 64 * 2**20


def chunk_tokens(chunk_size: int | None, vocab_size: int) -> int:
    """Tokens per chunk: chunk_size, or for None (auto) AUTO_CHUNK_BYTES of fp32 logits."""
    return chunk_size if chunk_size else max(16, AUTO_CHUNK_BYTES // (4 * vocab_size))


class _HiddenOut(torch.nn.Module):
    """Stands in for the output layer during a chunked forward: the final hidden states pass
    through (the model returns them where it returned logits). Its `weight` is the real layer's
    (not registered here): Mamba's forward casts the hidden states to lm_head.weight's dtype."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.__dict__["_head"] = head  # (outside _modules: not this module's parameters)

    @property
    def weight(self):
        return self.__dict__["_head"].weight

    def forward(self, hidden):
        return hidden


class OutputLayer(NamedTuple):
    """What turns final hidden states into logits: the output layer (a LoRA-wrapped one as it
    is) and the model's logit soft-capping (Gemma2's final_logit_softcapping; None: none)."""

    head: torch.nn.Module
    softcap: float | None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = getattr(self.head, "weight", None)
        if isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype:
            # Mamba's forward upcasts what its head returns to fp32 (its logits; here the hidden
            # states): they go back to the head's dtype, as its own forward feeds the head. (Under
            # autocast the head casts its input to bf16 anyway: bf16 -> fp32 -> bf16 is exact.)
            hidden = hidden.to(weight.dtype)
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
    m.set_output_embeddings(_HiddenOut(head))
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


def _chunk_scores(
    out: OutputLayer, hidden, targets, temperature, with_entropy, top_k, top_p, entropy_grad=False
):
    """One chunk: hidden [n, H], targets [n] -> (logps [n], entropy [n] or None, behaviour [n]).
    Its logits [n, V] live only inside (recomputed in the backward: chunked_scores). entropy_grad:
    the entropy keeps its gradient."""
    logits = out.logits(hidden).float()  # [n, V]
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]
    logps = picked - torch.logsumexp(logits, dim=-1)
    entropy = behaviour = None
    if entropy_grad:
        logp = F.log_softmax(logits, dim=-1)  # [n, V]
        entropy = -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        row = logits.detach()
        if with_entropy and not entropy_grad:
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


def _logit_grad(probs, targets, scale, temperature, capped, start=0, extra=None):
    """d log p(target) / d (output layer's logits) [n, V], times scale [n] (None: 1), plus `extra`
    (another gradient wrt the tempered logits, [n, V]: the entropy's); overwrites probs and capped:
    ((onehot - p) scale + extra) / temperature, through the soft-capping's tanh if any. probs may
    be the vocabulary's columns start.. only (a target outside them gets no onehot)."""
    grad = probs.neg_()
    local = targets - start
    inside = (local >= 0) & (local < grad.shape[1])  # [n]
    grad.scatter_add_(
        -1, local.clamp(0, grad.shape[1] - 1).unsqueeze(-1), inside.to(grad.dtype).unsqueeze(-1)
    )
    if scale is not None:
        grad.mul_(scale.unsqueeze(-1))
    if extra is not None:
        grad.add_(extra)
    if temperature != 1.0:
        grad.div_(temperature)
    if capped is not None:
        grad.mul_(capped.square_().neg_().add_(1))
    return grad


def _entropy_logit_grad(probs, entropy):
    """d H / d (tempered logits) [n, V] of the entropy H = -sum p log p: -p (log p + H) (p [n, V]
    normalised, H [n]; p log p is 0 where p underflows to 0)."""
    return torch.special.xlogy(probs, probs).add_(probs * entropy.unsqueeze(-1)).neg_()


@dataclasses.dataclass(frozen=True)
class _HeadSpec:
    """How _LinearHeadScores scores: the settings its forward, its backward and their helpers share
    (what chunked_scores passes it besides the tensors)."""

    temperature: float
    softcap: float | None  # the model's logit soft-capping (OutputLayer.softcap; None: none)
    chunk: int  # tokens per chunk
    with_entropy: bool
    top_k: int
    top_p: float
    entropy_grad: bool = False  # the entropy keeps its gradient (the entropy bonus)


def _head_pass(h, w, b, targets, spec: _HeadSpec, *, dhidden, dentropy=None):
    """The chunk loop of _LinearHeadScores.forward (no autograd): hidden h [N, H] and output layer
    (w, b) already in the compute dtype -> (logps, entropy, behaviour, lse) [N] each, and, when
    dhidden [N, H] is given, d log p / d hidden written into it (and d H / d hidden into
    dentropy [N, H], when given)."""
    temperature, softcap, chunk = spec.temperature, spec.softcap, spec.chunk
    with_entropy, top_k, top_p = spec.with_entropy or spec.entropy_grad, spec.top_k, spec.top_p
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
        if dentropy is not None:  # before _logit_grad overwrites probs and capped
            dent = _entropy_logit_grad(probs, ent)  # [n, V]
            if temperature != 1.0:
                dent.div_(temperature)
            if capped is not None:
                dent.mul_(1 - capped.square())
            dentropy[part] = dent.to(w.dtype) @ w  # [n, H]
            del dent
        if dhidden is not None:
            dlogits = _logit_grad(probs, targets[part], None, temperature, capped)  # [n, V]
            dhidden[part] = dlogits.to(w.dtype) @ w  # [n, H]
        del probs, capped
    return logps, entropy, behaviour, lses


def _head_scores(hidden, weight, bias, targets, spec: _HeadSpec, *, with_dhidden):
    """hidden [N, H], the output layer (weight, bias) cast to the compute dtype (autocast off
    inside: the dtypes are set here), and _head_pass on them: ((h, w, b, dhidden, dentropy),
    (logps, entropy, behaviour, lse)); dhidden [N, H] (d log p / d hidden) only when with_dhidden,
    dentropy [N, H] (d H / d hidden) when also spec.entropy_grad."""
    dtype = _compute_dtype(weight)
    with torch.autocast(weight.device.type, enabled=False):
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        h = hidden.to(dtype)
        dhidden = torch.empty(h.shape, device=h.device, dtype=dtype) if with_dhidden else None
        dentropy = (
            torch.empty(h.shape, device=h.device, dtype=dtype) if with_dhidden and spec.entropy_grad else None
        )
        scores = _head_pass(h, w, b, targets, spec, dhidden=dhidden, dentropy=dentropy)
    return (h, w, b, dhidden, dentropy), scores


class _Operands(NamedTuple):
    """The output layer's matmul operands, in the compute dtype (_head_scores casts them)."""

    h: torch.Tensor  # [N, H] hidden states
    w: torch.Tensor  # [V, H] weight
    b: torch.Tensor | None  # [V] bias


def _head_weight_grad(
    ops: _Operands, targets, lses, dlogps, spec: _HeadSpec, weight_dtype, entropy=None, dentropy=None
):
    """The output layer's gradient (weight [V, H], bias [V] or None) in weight_dtype, from the
    operands ops (hidden h [N, H] and (w, b) in the compute dtype), the forward's logsumexps
    lses [N] and the upstream dlogps [N] (and, for the entropy's gradient, the entropy [N] and its
    upstream dentropy [N]; None: none). Sliced by vocabulary rows, not by tokens: each slice recomputes its logits for all
    N tokens ([N, v], as many elements as a token chunk's [chunk, V]) and writes its rows of the
    gradient with one matmul over all tokens. A token-chunked loop would add a whole [V, H]
    partial gradient per chunk (a bf16 temporary and an fp32 read-modify-write of V * H each
    time); this writes each row once, and sums the tokens inside the matmul (fp32 accumulation,
    one rounding to the compute dtype, as autograd's own matmul would)."""
    h, w, b = ops
    temperature, softcap, chunk = spec.temperature, spec.softcap, spec.chunk
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
            extra = None
            if dentropy is not None:
                extra = _entropy_logit_grad(probs, entropy).mul_(dentropy.unsqueeze(-1))  # [N, v]
            dlogits = _logit_grad(probs, targets, dlogps, temperature, capped, start, extra)  # [N, v]
            if w.dtype == grad_weight.dtype:
                torch.mm(dlogits.to(w.dtype).t(), h, out=grad_weight[part])
            else:  # a bf16/fp16 matmul, as autograd's would be
                grad_weight[part] = dlogits.to(w.dtype).t() @ h
            if grad_bias is not None:
                grad_bias[part] = dlogits.sum(0)
            del logits, probs, dlogits, capped, extra
    return grad_weight, grad_bias


class _LinearHeadScores(torch.autograd.Function):
    """TokenScores from final hidden states [N, H] through a plain linear output layer, chunk by
    chunk, with a hand-written backward. The forward keeps, per token, d log p / d hidden (=
    (onehot - p) W / T, [N, H]: the size of the hidden states) and the row's logsumexp, so the
    gradient to the hidden states costs no recompute; only a trained output layer's own gradient
    recomputes the logits in the backward (_head_weight_grad: a slice of the vocabulary for every
    token at a time, as many elements as a chunk). No [n, V] tensor outlives its chunk.
    The behaviour log-probs carry no gradient (the sampler's contract); the entropy carries one
    only under spec.entropy_grad (the entropy bonus: d H / d hidden kept per token too, [N, H])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: _HeadSpec):
        train_head = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        (h, w, b, dhidden, dentropy), (logps, entropy, behaviour, lses) = _head_scores(
            hidden, weight, bias, targets, spec, with_dhidden=ctx.needs_input_grad[0]
        )
        if train_head:
            ctx.save_for_backward(dhidden, dentropy, h, w, b, targets, lses, entropy)
        else:
            ctx.save_for_backward(dhidden, dentropy)
        ctx.args = (spec, hidden.dtype, weight.dtype, train_head)
        fixed = (behaviour,) if spec.entropy_grad else (entropy, behaviour)
        ctx.mark_non_differentiable(*(t for t in fixed if t is not None))
        return logps, entropy, behaviour

    @staticmethod
    def backward(ctx, dlogps, dentropy_up, _dbehaviour):
        spec, hidden_dtype, weight_dtype, train_head = ctx.args
        dhidden, dentropy, *rest = ctx.saved_tensors
        dlogps = dlogps.float()  # [N]
        up = None if dentropy_up is None or not spec.entropy_grad else dentropy_up.float()  # [N]
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad = dhidden.float() * dlogps.unsqueeze(-1)  # [N, H]
            if up is not None:
                grad = grad + dentropy.float() * up.unsqueeze(-1)
            grad_hidden = grad.to(hidden_dtype)
        if train_head:
            h, w, b, targets, lses, entropy = rest
            grad_weight, grad_bias = _head_weight_grad(
                _Operands(h, w, b), targets, lses, dlogps, spec, weight_dtype, entropy, up
            )
        return grad_hidden, grad_weight, grad_bias, None, None


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
    options: ScoringOptions,
    *,
    chunk: int,
) -> TokenScores:
    """TokenScores of targets [B, T] from final hidden states [B, T, H], `chunk` tokens at a time
    (options: the temperature, with_entropy, top_k and top_p; its chunk_size is the caller's):
    the same numbers as token_scores on the whole logits, with at most one chunk's [chunk, V]
    logits alive. A plain linear output layer runs _LinearHeadScores (its own backward); any other
    (a LoRA-wrapped one) runs its chunks under torch.utils.checkpoint, which recomputes a chunk's
    forward in the backward."""
    from torch.utils.checkpoint import checkpoint

    temperature, with_entropy, top_k, top_p = (
        options.temperature,
        options.with_entropy,
        options.top_k,
        options.top_p,
    )
    B, T, H = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(B * T, H), targets.reshape(B * T)
    truncating = truncates(top_k, top_p)
    if _plain_linear(out.head):
        head = out.head
        spec = _HeadSpec(temperature, out.softcap, chunk, with_entropy, top_k, top_p, options.entropy_grad)
        if torch.is_grad_enabled():
            logps, entropy, behaviour = _LinearHeadScores.apply(
                flat_hidden, head.weight, head.bias, flat_targets, spec
            )
        else:  # (the reference pass, evaluation: nothing kept for a backward)
            _, (logps, entropy, behaviour, _) = _head_scores(
                flat_hidden, head.weight, head.bias, flat_targets, spec, with_dhidden=False
            )
        view = lambda t: None if t is None else t.view(B, T)  # noqa: E731
        logps = logps.view(B, T)
        return TokenScores(logps, view(entropy), view(behaviour) if truncating else logps.detach())
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logps, entropies, behaviours = [], [], []
    for start in range(0, B * T, chunk):
        args = (out, flat_hidden[start : start + chunk], flat_targets[start : start + chunk])
        rest = (temperature, with_entropy, top_k, top_p, options.entropy_grad)
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
        torch.cat(entropies).view(B, T) if with_entropy or options.entropy_grad else None,
        torch.cat(behaviours).view(B, T) if truncating else logps.detach(),
    )
