"""The per-token terms of the loss: the importance ratio, the policy terms a loss variant picks
(the table in ``grpo_cli/loss/__init__.py``), the KL penalty and the TIS weights.

Policy term
-----------
Per token ``t`` of row ``i`` with ratio ``r = exp(logp - old_logp)``::

    surrogate = -min(r * A_i, clip(r, 1 - epsilon, 1 + epsilon_high) * A_i)
    loss_tok  = surrogate + beta * KL(policy || ref)

``importance_sampling_level="sequence"`` (GSPO) replaces ``r`` by one ratio per
row, ``exp(mean over the row's valid tokens of (logp - old_logp))``. ``delta``
caps the unclipped ratio (two-sided clipping as in TRL). KL estimators, with
``x = ref_logp - logp``: ``k1 = -x``, ``k2 = x**2 / 2``, ``k3 = exp(x) - x - 1``
(default, never negative).

A policy term is a pure function ``(ratio [B, T], adv [B, 1], cfg) -> [B, T]`` (the loss, not
the objective: lower is better); :func:`clipped_surrogate` is the one every shipped variant uses.

Zero-std groups (ref 002), ``zero_std=``:

* ``"mask"`` (default): flagged rows leave the loss entirely, KL included, and
  are not counted by the normalisers: exactly zero gradient.
* ``"weight"``: each row's KL is scaled by
  ``sigmoid((group_std - zero_std_floor) / zero_std_width)`` (:func:`kl_penalty`).
* ``"keep"``: TRL behaviour; the KL still pulls signal-free groups toward the
  reference (the bug of ref 002, kept for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_cli.loss.options import (
    IS_LEVELS,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    LossConfig,
    _check_choice,
    _compute_dtype,
)

# zero_std="weight" (ref 002 option 2): the KL term of a row is weighted by
# sigmoid((group std - floor) / width): ~0 without reward spread, ~1 above the floor.
ZERO_STD_FLOOR = 0.05
ZERO_STD_WIDTH = 0.01


def importance_ratio(
    logps: Tensor,
    old_logps: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
) -> Tensor:
    """Importance ratio ``pi / pi_old`` per token, ``[B, T]``.

    ``old_logps`` must come from the policy that sampled the batch (ref 000.1);
    they are detached here, so passing the current forward pass by mistake
    still yields the on-policy gradient instead of a silent zero.

    ``level="token"``: ``exp(logp - old_logp)``. ``level="sequence"`` (GSPO):
    ``exp(mean over the row's valid tokens of (logp - old_logp))``, constant
    along the row. Masked positions are zeroed *before* any arithmetic (they
    may hold -inf/NaN garbage) and give ratio 1. Log-ratios are clamped to
    ``+-LOG_RATIO_CLAMP`` so exp stays finite; beyond the clamp the gradient
    is zero.
    """
    _check_choice("importance_sampling_level", level, IS_LEVELS)
    valid = mask != 0  # [B, T] bool
    cdtype = _compute_dtype(logps.dtype)
    diff = logps.to(cdtype) - old_logps.detach().to(cdtype)  # [B, T]
    # where(), not multiply: 0 * inf = NaN, and where() also sends zero gradient to
    # the garbage positions.
    log_ratio = torch.where(valid, diff, torch.zeros_like(diff))  # [B, T]
    if level == "sequence":
        n_tok = valid.sum(dim=1, keepdim=True).clamp(min=1).to(cdtype)  # [B, 1]
        seq = log_ratio.sum(dim=1, keepdim=True) / n_tok  # [B, 1]
        log_ratio = seq.expand_as(log_ratio)  # [B, T], constant along each row
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    return torch.exp(log_ratio)  # [B, T]


def clip_range(cfg: LossConfig) -> tuple[float, float]:
    """``(eps_low, eps_high)``: the ratio's trust region is ``[1 - eps_low, 1 + eps_high]``;
    ``epsilon_high`` defaults to ``epsilon`` (DAPO clip-higher when larger)."""
    eps_low = float(cfg.epsilon)
    eps_high = eps_low if cfg.epsilon_high is None else float(cfg.epsilon_high)
    return eps_low, eps_high


def clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """The clipped GRPO/PPO surrogate per token, ``[B, T]``: ``-min(r A, clip(r) A)`` with the
    ratio ``r`` ``[B, T]`` and the advantages ``A`` ``[B, 1]``; reads ``epsilon``,
    ``epsilon_high`` and ``delta`` (an optional cap on the unclipped ratio, TRL two-sided
    clipping)."""
    eps_low, eps_high = clip_range(cfg)
    delta = cfg.delta
    unclipped = ratio if delta is None else ratio.clamp(max=delta)  # [B, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    # Pessimistic bound: on the side where the ratio left the trust region in the
    # advantage's direction, min() picks the constant clipped branch -> zero gradient.
    return -torch.minimum(unclipped * adv, clipped * adv)  # [B, T]


def per_token_kl(
    logps: Tensor,
    ref_logps: Tensor,
    mask: Tensor | None = None,
    *,
    estimator: str = "k3",
) -> Tensor:
    """Per-token estimate of ``KL(policy || ref)``, ``[B, T]`` (ref 004).

    With ``x = ref_logp - logp``: ``k1 = -x`` (unbiased, can be negative),
    ``k2 = x**2 / 2``, ``k3 = exp(x) - x - 1`` (unbiased, never negative).
    Masked positions (if ``mask`` is given) are 0 and carry no gradient.
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    cdtype = _compute_dtype(logps.dtype)
    x = ref_logps.detach().to(cdtype) - logps.to(cdtype)  # [B, T]
    if mask is not None:
        x = torch.where(mask != 0, x, torch.zeros_like(x))  # [B, T]
    if estimator == "k1":
        return -x  # [B, T]
    if estimator == "k2":
        return 0.5 * x.pow(2)  # [B, T]
    # k3: clamp so exp() stays finite (zero gradient beyond the clamp). expm1(x) - x is
    # the same value as exp(x) - x - 1 with less cancellation near x = 0; clamp(min=0)
    # removes any last-ulp negative so k3 >= 0 holds exactly (ref 004).
    x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    return (torch.expm1(x) - x).clamp(min=0.0)  # [B, T]


def kl_penalty(kl: Tensor, cfg: LossConfig, group_std: Tensor | None) -> Tensor:
    """``beta * KL`` per token, ``[B, T]``, from :func:`per_token_kl`'s ``kl`` ``[B, T]``; under
    ``zero_std="weight"`` each row's KL is weighted by its group's ``group_std`` ``[B]``."""
    kl_term = kl  # [B, T]
    if cfg.zero_std == "weight":
        # ref 002 option 2: ~0 for groups without reward spread, ~1 above the floor.
        w = torch.sigmoid(
            (group_std.detach().to(device=kl.device, dtype=kl.dtype) - ZERO_STD_FLOOR) / ZERO_STD_WIDTH
        )  # [B]
        kl_term = kl_term * w.unsqueeze(1)  # [B, T]
    return cfg.beta * kl_term  # [B, T]


def teacher_term(
    logps: Tensor, teacher_logps: Tensor, ratio: Tensor, mask: Tensor, coef: float, all_tokens: int
) -> Tensor:
    """On-policy distillation's term, ``[]``: ``coef * sum(sg(k1) * r) / all_tokens`` over the
    trained tokens ``mask`` ``[B, T]`` (zero-std rows included), with ``k1 = logp - teacher_logp``
    per sampled token (the reverse KL's estimator: its mean under the policy is KL(policy ||
    teacher)) and ``r`` the importance ratio ``[B, T]`` (1 on policy). Its gradient, ``k1 * d log p``
    per token, is the score-function gradient of the per-token reverse KL: the teacher's log-prob
    of each sampled token acts as a per-token reward (the on-policy distillation of Agarwal et al.
    and Thinking Machines, TRL's DistillationTrainer at beta=1 on the sampled tokens only)."""
    cdtype = _compute_dtype(logps.dtype)
    k1 = logps.detach().to(cdtype) - teacher_logps.detach().to(cdtype)  # [B, T]
    per_token = torch.where(mask, k1 * ratio, torch.zeros_like(k1))  # [B, T]
    return coef * per_token.sum() / max(all_tokens, 1)


def high_entropy_mask(entropy: Tensor, valid: Tensor, quantile: float) -> Tensor:
    """``[B, T]`` bool: the valid tokens whose entropy is at least the ``1 - quantile`` quantile of
    the valid tokens' entropies (torch.quantile's linear interpolation), as TRL's
    ``get_high_entropy_mask`` (trl/trainer/grpo_trainer.py, 1.16: lines 1380-1416) over this
    call's tokens. No valid token: none kept."""
    e = entropy.detach()
    kept = e[valid].to(_compute_dtype(e.dtype))  # [n] (fp64 stays: the threshold is one of them)
    if kept.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(kept, 1.0 - quantile)
    return (e >= threshold) & valid  # [B, T]


def entropy_bonus(entropy: Tensor, keep: Tensor, coef: float, num_tokens: int) -> Tensor:
    """``-coef * sum(H over keep) / num_tokens``, ``[]``: the entropy bonus of one micro-batch, its
    share of the step's mean over ``num_tokens`` (the step's tokens in the loss: the micro-batches
    sum to the step's mean, gradient accumulation invariant). ``keep`` ``[B, T]`` bool."""
    h = torch.where(
        keep,
        entropy.to(_compute_dtype(entropy.dtype)),
        torch.zeros((), dtype=_compute_dtype(entropy.dtype), device=entropy.device),
    )
    return -coef * h.sum() / max(num_tokens, 1)


def adapt_entropy_coef(coef: float, entropy: float, cfg) -> float:
    """The adaptive entropy controller's next coefficient (TRL 1.16's ``use_adaptive_entropy``,
    trl/trainer/grpo_trainer.py lines 3216-3240, after Skywork-OR1): ``coef + entropy_coef_delta``
    when the step's entropy is at or below ``cfg.entropy_target``, ``coef - entropy_coef_delta``
    otherwise, held within ``[entropy_coef_min, entropy_coef_max]``."""
    if entropy <= cfg.entropy_target:
        return min(coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
    return max(coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)


def applied_entropy_coef(coef: float, last_entropy: float, cfg) -> float:
    """The entropy bonus's coefficient for a step: ``cfg.entropy_coef`` without adaptive control;
    with it, the controller's ``coef`` where the previous step's entropy was at or below the target
    and 0 otherwise (TRL line 3207; ``last_entropy`` is inf before the first step: no bonus)."""
    if not cfg.use_adaptive_entropy:
        return cfg.entropy_coef
    return coef if last_entropy <= cfg.entropy_target else 0.0


def sequence_mask_weights(
    trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor, *, cap: float | None, floor: float | None
) -> Tensor:
    """Sequence-level masked importance sampling, ``[B, T]`` (TRL 1.16's default
    ``vllm_importance_sampling_mode="sequence_mask"``, trl/trainer/grpo_trainer.py lines 2660-2702):
    one ratio per row, ``exp(sum over its valid tokens of trainer - sampler log-prob)``, the row's
    weight where it lies in ``[floor, cap]`` and 0 (the whole sequence masked) where it does not;
    None: no bound on that side. Detached; constant along a row."""
    cdtype = _compute_dtype(trainer_logps.dtype)
    diff = trainer_logps.detach().to(cdtype) - sampler_logps.detach().to(cdtype)  # [B, T]
    diff = torch.where(mask != 0, diff, torch.zeros_like(diff)).nan_to_num(0.0)  # [B, T]
    ratio = torch.exp(diff.sum(dim=1, keepdim=True).clamp(max=LOG_RATIO_CLAMP))  # [B, 1]
    out = (ratio > cap) if cap is not None else torch.zeros_like(ratio, dtype=torch.bool)  # [B, 1]
    if floor is not None:
        out = out | (ratio < floor)
    return torch.where(out, torch.zeros_like(ratio), ratio).expand_as(diff)  # [B, T]


def off_policy_mask(
    logps: Tensor, sampler_logps: Tensor, adv: Tensor, valid: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, ``[B, 1]`` bool (True: kept), as TRL's
    ``get_off_policy_mask`` (lines 2945-2969): a row leaves the policy term where its advantage
    is negative and its mean per-token ``sampler_logp - logp`` (a KL estimate from the sampler's
    distribution to the current policy, detached) over its valid tokens exceeds ``threshold``."""
    cdtype = _compute_dtype(logps.dtype)
    kl = (sampler_logps.detach().to(cdtype) - logps.detach().to(cdtype)).nan_to_num(0.0)  # [B, T]
    kl = torch.where(valid, kl, torch.zeros_like(kl))
    mean_kl = kl.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    return (adv >= 0) | (mean_kl <= threshold)  # [B, 1]


def truncated_importance_weights(
    trainer_logps: Tensor,
    sampler_logps: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
) -> Tensor:
    """Truncated importance sampling (TIS) weights ``min(exp(trainer - sampler), cap)``, ``[B, T]``.

    The ratio's old log-probs are the trainer's own (so the first ratio is exactly 1);
    when the sampler computes the distribution with other numerics (bf16 decode, a
    faster engine), the samples came from a slightly different policy. These weights
    correct the policy term for that mismatch, truncated at ``cap`` to bound the
    variance. Detached; 1 at masked positions.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    cdtype = _compute_dtype(trainer_logps.dtype)
    diff = trainer_logps.detach().to(cdtype) - sampler_logps.detach().to(cdtype)  # [B, T]
    diff = torch.where(mask != 0, diff, torch.zeros_like(diff)).clamp(max=LOG_RATIO_CLAMP)  # [B, T]
    return torch.exp(diff).clamp(max=cap)  # [B, T]


#: loss.sampler_correction's values that weight the policy term (sampler_weights); the others
#: ("none", and "auto" once resolved to one of these or none) leave it as it is.
SAMPLER_CORRECTIONS = ("tis", "sequence_mask")


def sampler_weights(
    behaviour: Tensor, sampler_logps: Tensor, mask: Tensor, *, cfg
) -> tuple[Tensor, int | None]:
    """loss.sampler_correction's per-token weights of the policy term ``[B, T]`` for the sampler's
    mismatch (behaviour: the trainer's replay of the distribution the tokens were drawn from,
    TokenScores.behaviour), and the rows they mask (None where the correction masks none): TIS's
    truncated ratio (truncated_importance_weights) or the sequence mask's 0/1 rows
    (sequence_mask_weights). cfg: the loss section (its correction one of SAMPLER_CORRECTIONS)."""
    if cfg.sampler_correction == "tis":
        return truncated_importance_weights(behaviour, sampler_logps, mask, cap=cfg.tis_cap), None
    if cfg.sampler_correction == "sequence_mask":
        weights = sequence_mask_weights(behaviour, sampler_logps, mask, cap=cfg.tis_cap, floor=cfg.tis_min)
        return weights, int((weights[:, 0] == 0).sum())
    raise ValueError(f"sampler_weights: loss.sampler_correction={cfg.sampler_correction!r} weights nothing")


# ---------------------------------------------------------------------------------------------
# CISPO and SAPO (TRL 1.16, trl/trainer/grpo_trainer.py, _compute_loss; docs/reference.md)


@dataclass(frozen=True)
class CispoOptions:
    """loss=cispo's options (loss.options.<name>)."""

    # The cap on the importance weight (ScaleRL's epsilon_max; TRL's epsilon_high under
    # loss_type=cispo, which it recommends at 5.0): tokens whose ratio exceeds it keep their
    # gradient, weighted by the cap.
    weight_max: float = 5.0


@dataclass(frozen=True)
class SapoOptions:
    """loss=sapo's options (loss.options.<name>): the soft gate's temperatures (TRL's defaults)."""

    temperature_pos: float = 1.0  # tokens of rows with a positive advantage
    temperature_neg: float = 1.05  # the others: a slightly sharper gate


def _typed(cfg: LossConfig, kind: type):
    """The loss section's `options` as the variant's typed options (validated before the run)."""
    return kind(**dict(getattr(cfg, "options", None) or {}))


def cispo(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """CISPO per token, ``[B, T]``: ``-sg(min(r, weight_max)) * A * log r`` (MiniMax-M1; TRL's
    ``-clamp(coef_1, max=epsilon_high).detach() * advantages * per_token_logps``). The weight is
    detached and clipped, never the token: every token keeps a gradient, ``-w A d log p``. The
    value differs from TRL's by ``-w A old_logp`` (``log r = logp - old_logp``), a constant of
    zero gradient."""
    w = ratio.detach().clamp(max=_typed(cfg, CispoOptions).weight_max)  # [B, T]
    return -w * adv * torch.log(ratio)  # [B, T]


def cispo_stats(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> dict[str, Tensor]:
    """cispo_clip_ratio (TRL's metric): the tokens whose weight the cap lowered, of rows with a
    positive advantage, ``[B, T]`` bool."""
    return {"cispo_clip_ratio": (ratio.detach() > _typed(cfg, CispoOptions).weight_max) & (adv > 0)}


def _sapo_temperature(adv: Tensor, cfg: LossConfig) -> Tensor:
    o = _typed(cfg, SapoOptions)
    pos, neg = (
        torch.tensor(float(t), dtype=adv.dtype, device=adv.device)
        for t in (o.temperature_pos, o.temperature_neg)
    )
    return torch.where(adv > 0, pos, neg)  # [B, 1], in the advantages' dtype (1.05 not rounded to fp32)


def sapo(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """SAPO per token, ``[B, T]``: ``-(4 / tau) * sigmoid(tau * (r - 1)) * A`` (Soft Adaptive
    Policy Optimization; TRL's ``soft_coef_1``), tau = temperature_pos where A > 0, else
    temperature_neg. A soft gate in place of the hard clip: the gradient's weight
    ``4 sigmoid(x)(1 - sigmoid(x))``, x = tau (r - 1), is 1 on policy and decays smoothly as the
    ratio leaves 1 in either direction."""
    tau = _sapo_temperature(adv, cfg)  # [B, 1]
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv  # [B, T]


def sapo_stats(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> dict[str, Tensor]:
    """sapo/gate_mean: the soft gate's weight on each token's gradient (1 on policy), ``[B, T]``."""
    s = torch.sigmoid(_sapo_temperature(adv, cfg) * (ratio.detach() - 1.0))  # [B, T]
    return {"sapo/gate_mean": 4.0 * s * (1.0 - s)}
