"""GRPO advantages and loss: pure functions, tensors in, tensors out.

Nothing here knows about models, Hydra or optimizers: the options come as the
loss section of the typed config (config.LossConfig), read by attribute. The
training step computes per-token log-probs, calls :func:`group_advantages` once per rollout,
:func:`loss_normalizers` once per optimizer step, and :func:`grpo_loss` once per
micro-batch. References like ``ref 002`` point at the numbered rules of
``docs/reference.md``.

Shapes
------
``B`` rows (completions), ``T`` completion tokens per row (right-padded),
``G`` completions per prompt. Rows arrive in consecutive groups of ``G``.

Advantages (ref 004)
--------------------
* ``estimator="grpo"``: ``A_i = r_i - mean(group)``.
* ``estimator="rloo"``: leave-one-out baseline ``A_i = r_i - mean(others)``,
  which equals ``G/(G-1) * (r_i - mean(group))``.
* ``scale_rewards``: ``"group"`` divides by ``std(group) + eps``; ``"batch"``
  divides by ``std(batch) + eps`` (the mean stays per group); ``"none"`` does
  not divide (Dr. GRPO; classic unscaled RLOO is ``estimator="rloo",
  scale_rewards="none"``).
* ``std="population"`` (default, ``unbiased=False``) or ``"sample"``
  (Bessel-corrected, ``torch.std``'s default and TRL's choice, ref 000.6).
  Population is the default because GRPO groups are small: the sample std
  inflates the divisor by ``sqrt(G/(G-1))``. For ``G=2`` and rewards ``{0, 1}``
  population std gives advantages ``+-1``; sample std gives ``+-0.707``.
  With the population std the advantages of every non-degenerate group have
  unit RMS, whatever ``G`` is, so changing ``G`` does not silently rescale the
  learning rate.
* Groups whose std is below ``zero_std_threshold`` carry no learning signal
  (ref 002); they are flagged and their advantages are exactly ``0``.

Loss
----
Per token ``t`` of row ``i`` with ratio ``r = exp(logp - old_logp)``::

    surrogate = -min(r * A_i, clip(r, 1 - epsilon, 1 + epsilon_high) * A_i)
    loss_tok  = surrogate + beta * KL(policy || ref)

``importance_sampling_level="sequence"`` (GSPO) replaces ``r`` by one ratio per
row, ``exp(mean over the row's valid tokens of (logp - old_logp))``. ``delta``
caps the unclipped ratio (two-sided clipping as in TRL). KL estimators, with
``x = ref_logp - logp``: ``k1 = -x``, ``k2 = x**2 / 2``, ``k3 = exp(x) - x - 1``
(default, never negative).

Zero-std groups (ref 002), ``zero_std=``:

* ``"mask"`` (default): flagged rows leave the loss entirely, KL included, and
  are not counted by the normalisers: exactly zero gradient.
* ``"weight"``: each row's KL is scaled by
  ``sigmoid((group_std - zero_std_floor) / zero_std_width)``.
* ``"keep"``: TRL behaviour; the KL still pulls signal-free groups toward the
  reference (the bug of ref 002, kept for comparison).

Normalisation (``loss_type``), ref 000.6 and ref 004 (length bias). ``N`` is the
number of sequences and ``M`` the number of valid tokens entering the loss over
the whole optimizer step, ``n_i`` the valid tokens of row ``i``, ``L`` =
``max_new_tokens``:

* ``"grpo"``: ``sum_i (sum_t loss_it / n_i) / N``: every sequence weighs the
  same, so tokens of long completions weigh less (length bias).
* ``"bnpo"`` / ``"dapo"``: ``sum_it loss_it / M``: every token weighs the same.
  On one device, normalised over the whole step, the two coincide; TRL only
  distinguishes them by how tokens are counted across processes.
* ``"dr_grpo"``: ``sum_it loss_it / (N * L)``: a constant denominator.

Because ``N`` and ``M`` are step totals (from :func:`loss_normalizers`), each
micro-batch loss is a partial sum of the full-batch loss: summing micro-batch
losses (no extra division by the number of accumulation steps) gives exactly
the full-batch loss and gradient. Nothing here assumes a batch size.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class LossConfig(Protocol):
    """What the math reads of the loss section (config.schema.LossConfig, a plain dataclass): the
    options by attribute, nothing of Hydra or of the rest of the config."""

    beta: float
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    loss_type: str
    kl_estimator: str
    importance_sampling_level: str
    scale_rewards: str
    std: str
    estimator: str
    eps: float
    zero_std: str
    zero_std_threshold: float


__all__ = [
    "group_advantages",
    "zero_std_groups",
    "loss_normalizers",
    "grpo_loss",
    "importance_ratio",
    "per_token_kl",
    "has_learning_signal",
    "truncated_importance_weights",
    "LOG_RATIO_CLAMP",
]

# Log-ratios and KL log-differences are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]
# before exp(). exp(20) ~ 4.9e8 is finite in float16/bfloat16/float32. The clamp is
# flat outside the range, so tokens beyond it get zero gradient through that term.
LOG_RATIO_CLAMP = 20.0

SCALE_REWARDS = ("group", "batch", "none")
STD_KINDS = ("population", "sample")
ESTIMATORS = ("grpo", "rloo")
IS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ZERO_STD_MODES = ("mask", "weight", "keep")
SAMPLER_CORRECTIONS = ("auto", "none", "tis")  # tis: truncated_importance_weights; auto: config.schema
# zero_std="weight" (ref 002 option 2): the KL term of a row is weighted by
# sigmoid((group std - floor) / width): ~0 without reward spread, ~1 above the floor.
ZERO_STD_FLOOR = 0.05
ZERO_STD_WIDTH = 0.01


def _check_choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name}={value!r}; valid values: {', '.join(repr(v) for v in valid)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 or higher: bf16/fp16 (and integer rewards) are upcast, float64 is kept.
    return torch.promote_types(dtype, torch.float32)


def _std(x: Tensor, dim: int | None, kind: str) -> Tensor:
    """Population or sample std; a single element has std 0 under both kinds."""
    if dim is None:
        x = x.reshape(-1)
        dim = 0
    n = x.shape[dim]
    mean = x.mean(dim=dim, keepdim=True)
    sq = (x - mean).pow(2).sum(dim=dim)
    # ref 000.6: "sample" is torch.std's default (Bessel, n-1); clamp so n=1 gives 0, not NaN.
    denom = max(n - 1, 1) if kind == "sample" else max(n, 1)
    return (sq / denom).sqrt()


# --------------------------------------------------------------------------- advantages


def zero_std_groups(
    rewards: Tensor, num_generations: int, *, std: str = "population", zero_std_threshold: float = 1e-6
) -> Tensor:
    """``[B/G]`` bool: the groups whose reward std (of kind ``std``) is below the threshold.

    They carry no learning signal (ref 002). This is the one place that decides it: the
    advantages, the zero-std flags of the loss and dynamic sampling's choice of groups all
    come from here.
    """
    _check_choice("std", std, STD_KINDS)
    grouped = rewards.detach().to(_compute_dtype(rewards.dtype)).view(-1, num_generations)  # [B/G, G]
    return _std(grouped, dim=1, kind=std) < zero_std_threshold  # [B/G]


def group_advantages(
    rewards: Tensor, num_generations: int, *, cfg: LossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group advantages (ref 004): never normalised over the whole batch.

    Args:
        rewards: ``[B]`` total reward per completion, in consecutive groups of
            ``num_generations`` completions of one prompt. Any real dtype.
        num_generations: ``G``; ``B`` must be a multiple of it.
        cfg: the loss section (config.LossConfig); these fields are read:
        scale_rewards: ``"group"`` (divide by group std + eps), ``"batch"``
            (divide by batch std + eps, mean still per group) or ``"none"``.
        std: ``"population"`` (default) or ``"sample"`` (TRL). With small ``G``
            the sample std inflates the divisor by ``sqrt(G/(G-1))`` (ref
            000.6): ``G=2``, rewards ``{0, 1}`` give ``+-1`` (population) vs
            ``+-0.707`` (sample). The population std gives every group's
            advantages unit RMS independent of ``G``.
        eps: added to the std before dividing (ref 004, ~1e-4).
        estimator: ``"grpo"`` (group-mean baseline) or ``"rloo"``
            (leave-one-out baseline, ``G/(G-1) * (r_i - mean)``; needs ``G>=2``).
        zero_std_threshold: groups with std below it are flagged (ref 002).

    Returns:
        ``(advantages [B], zero_std [B] bool, group_std [B])``, all detached,
        floating point (float32 or wider). ``advantages`` are exactly 0 in
        flagged groups; ``group_std`` is each row's group std of kind ``std``.
    """
    scale_rewards, std, eps, estimator = cfg.scale_rewards, cfg.std, cfg.eps, cfg.estimator
    G = num_generations
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    _check_choice("std", std, STD_KINDS)
    _check_choice("estimator", estimator, ESTIMATORS)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if not isinstance(G, int) or isinstance(G, bool) or G < 1:
        raise ValueError(f"num_generations must be a positive int, got {G!r}")
    batch = rewards.shape[0]
    if batch % G != 0:
        raise ValueError(
            f"batch of {batch} rewards is not a multiple of num_generations={G}; "
            "each prompt's completions must stay together"
        )
    if estimator == "rloo" and G < 2:
        raise ValueError("estimator='rloo' needs num_generations >= 2 (leave-one-out baseline)")

    # ref 004: advantages are constants; no gradient ever flows back into rewards.
    r = rewards.detach().to(_compute_dtype(rewards.dtype))  # [B]
    grouped = r.view(-1, G)  # [B/G, G]

    mean = grouped.mean(dim=1, keepdim=True)  # [B/G, 1]
    g_std = _std(grouped, dim=1, kind=std)  # [B/G]
    flagged = zero_std_groups(r, G, std=std, zero_std_threshold=cfg.zero_std_threshold)  # [B/G] bool

    centered = grouped - mean  # [B/G, G]
    if estimator == "rloo":
        # r_i - mean_{j != i} r_j == G/(G-1) * (r_i - mean): unbiased baseline (ref 004).
        centered = centered * (G / (G - 1))

    if scale_rewards == "group":
        adv = centered / (g_std.unsqueeze(1) + eps)  # [B/G, G]
    elif scale_rewards == "batch":
        # Only the scale is batch-wide; the baseline stays per group (ref 004).
        adv = centered / (_std(r, dim=None, kind=std) + eps)  # [B/G, G]
    else:  # "none": Dr. GRPO, unscaled
        adv = centered  # [B/G, G]

    # ref 002: a group without reward spread carries no signal; its advantages are
    # exactly 0 (not ~1e-9/eps noise from float rounding of the mean).
    adv = torch.where(flagged.unsqueeze(1), torch.zeros_like(adv), adv)  # [B/G, G]

    advantages = adv.reshape(-1)  # [B]
    zero_std = flagged.repeat_interleave(G)  # [B] bool
    group_std = g_std.repeat_interleave(G)  # [B]
    return advantages, zero_std, group_std


# --------------------------------------------------------------------------- normalisers


def _effective_mask(mask: Tensor, zero_std: Tensor | None, zero_std_mode: str) -> Tensor:
    """Bool ``[B, T]`` of tokens that enter the loss."""
    valid = mask != 0  # [B, T] bool (mask may be 0/1 float, int or bool)
    if zero_std_mode == "mask" and zero_std is not None:
        # ref 002 option 1: zero-std rows leave the loss entirely, KL included.
        valid = valid & ~zero_std.to(device=valid.device, dtype=torch.bool).unsqueeze(1)  # [B, T]
    return valid


def loss_normalizers(
    mask: Tensor,
    zero_std: Tensor | None = None,
    *,
    zero_std_mode: str = "mask",
) -> tuple[int, int]:
    """Sequences and tokens that enter the loss, for a whole optimizer step.

    Call once on the step's full batch and pass both numbers to every
    micro-batch call of :func:`grpo_loss` (gradient accumulation invariance).

    Args:
        mask: ``[B, T]`` completion-token mask (0/1 or bool).
        zero_std: ``[B]`` bool flags from :func:`group_advantages`, or None.
        zero_std_mode: as in :func:`grpo_loss`; only ``"mask"`` removes rows.

    Returns:
        ``(num_sequences, num_tokens)`` as Python ints. Rows without a valid
        token are not sequences; under ``"mask"`` flagged rows are excluded.
    """
    _check_choice("zero_std_mode", zero_std_mode, ZERO_STD_MODES)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if zero_std is not None and tuple(zero_std.shape) != (mask.shape[0],):
        raise ValueError(f"zero_std must be [B]={mask.shape[0]}, got shape {tuple(zero_std.shape)}")
    valid = _effective_mask(mask, zero_std, zero_std_mode)  # [B, T] bool
    num_sequences = int(valid.any(dim=1).sum().item())
    num_tokens = int(valid.sum().item())
    return num_sequences, num_tokens


def has_learning_signal(
    advantages: Tensor,
    mask: Tensor,
    zero_std: Tensor | None = None,
    *,
    zero_std_mode: str = "mask",
    beta: float = 0.0,
) -> bool:
    """Whether an update on this step has a reason to move the weights (ref 002).

    A step carries signal when a token entering the loss belongs to a row with a
    non-zero advantage, or when ``beta > 0`` and the KL term has tokens (under
    ``zero_std="keep"``/``"weight"`` the user chose to keep the KL pull on
    signal-free groups). Otherwise the loss and its gradient are exactly 0, and an
    optimizer step would still move the weights through AdamW's momentum and weight
    decay: the caller skips it.

    Args:
        advantages: ``[B]`` from :func:`group_advantages`.
        mask: ``[B, T]`` completion-token mask of the tokens the loss may use.
        zero_std: ``[B]`` bool flags, or None.
    """
    _check_choice("zero_std_mode", zero_std_mode, ZERO_STD_MODES)
    valid = _effective_mask(mask, zero_std, zero_std_mode)  # [B, T] bool
    rows = valid.any(dim=1)  # [B]
    if bool((rows & (advantages.to(rows.device) != 0)).any()):
        return True
    return beta > 0 and bool(rows.any())


# --------------------------------------------------------------------------- pieces


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


# --------------------------------------------------------------------------- loss


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    cfg: LossConfig,
    zero_std_flags: Tensor | None = None,
    group_std: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_generations: int | None = None,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO surrogate plus ``beta * KL``, reduced per ``loss_type``.

    Args:
        logps: ``[B, T]`` current-policy log-probs of the completion tokens
            (with gradient). Values at masked positions may be garbage.
        old_logps: ``[B, T]`` log-probs of the policy that sampled the batch
            (ref 000.1); detached here.
        ref_logps: ``[B, T]`` reference-model log-probs (for KL, not for the
            ratio), or None when ``beta == 0``.
        advantages: ``[B]`` from :func:`group_advantages`; detached here.
        mask: ``[B, T]`` completion-token mask, 0/1 or bool.
        cfg: the loss section (config.LossConfig); these fields are read:
        beta: KL coefficient (>= 0).
        epsilon, epsilon_high: clip range ``[1 - epsilon, 1 + epsilon_high]``;
            ``epsilon_high`` defaults to ``epsilon`` (DAPO clip-higher).
        delta: optional cap on the unclipped ratio (TRL two-sided clipping).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dapo"`` or ``"dr_grpo"`` (see
            the module docstring for the normalisation of each).
        zero_std: ``"mask"``, ``"weight"`` or ``"keep"`` (ref 002).
        zero_std_flags: ``[B]`` bool from :func:`group_advantages`; None means
            no row is flagged.
        group_std: ``[B]`` per-row group std; required by ``zero_std="weight"``.
        num_sequences, num_tokens: step totals from :func:`loss_normalizers`;
            default to this call's own counts.
        max_new_tokens: ``L`` for ``"dr_grpo"``; defaults to ``T``. Pass the
            configured completion limit when micro-batches are padded to
            different lengths.
        num_generations: only used for the ``num_zero_std_groups`` stat.
        importance_weights: optional ``[B, T]`` per-token weights of the policy
            term (not the KL term), e.g. :func:`truncated_importance_weights`
            for a sampler/trainer mismatch; detached here.

    Returns:
        ``(loss, stats)``: a scalar loss, and detached scalar stats ``kl``,
        ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean``, ``ratio_mean``, ``ratio_max``,
        ``num_tokens``, ``num_zero_std_rows`` and, when ``num_generations``
        is given, ``num_zero_std_groups``. Means are over the tokens that enter
        the loss in this call (0 when there are none).
    """
    # ---- options and shapes
    beta, epsilon, epsilon_high, delta = cfg.beta, cfg.epsilon, cfg.epsilon_high, cfg.delta
    importance_sampling_level, kl_estimator = cfg.importance_sampling_level, cfg.kl_estimator
    loss_type, zero_std = cfg.loss_type, cfg.zero_std
    _check_choice("importance_sampling_level", importance_sampling_level, IS_LEVELS)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("zero_std", zero_std, ZERO_STD_MODES)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logps (reference-model log-probs)")
    if zero_std == "weight" and group_std is None:
        raise ValueError("zero_std='weight' needs group_std (from group_advantages)")
    if logps.dim() != 2:
        raise ValueError(f"logps must be [B, T], got shape {tuple(logps.shape)}")
    shape = tuple(logps.shape)
    batch, seq_len = shape
    for name, t in (
        ("old_logps", old_logps),
        ("ref_logps", ref_logps),
        ("mask", mask),
        ("importance_weights", importance_weights),
    ):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have the shape of logps {shape}, got {tuple(t.shape)}")
    for name, t in (("advantages", advantages), ("zero_std_flags", zero_std_flags), ("group_std", group_std)):
        if t is not None and tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must be [B]=({batch},), got {tuple(t.shape)}")
    eps_low = float(epsilon)
    eps_high = eps_low if epsilon_high is None else float(epsilon_high)

    cdtype = _compute_dtype(logps.dtype)
    device = logps.device

    # ---- which tokens enter the loss
    valid = _effective_mask(mask, zero_std_flags, zero_std)  # [B, T] bool
    validf = valid.to(cdtype)  # [B, T]
    if num_sequences is None or num_tokens is None:
        own_seq, own_tok = loss_normalizers(mask, zero_std_flags, zero_std_mode=zero_std)
        num_sequences = own_seq if num_sequences is None else num_sequences
        num_tokens = own_tok if num_tokens is None else num_tokens
    if max_new_tokens is None:
        max_new_tokens = seq_len

    # ---- policy term
    adv = advantages.detach().to(device=device, dtype=cdtype).unsqueeze(1)  # [B, 1]
    ratio = importance_ratio(logps, old_logps, valid, level=importance_sampling_level)  # [B, T]
    unclipped = ratio if delta is None else ratio.clamp(max=delta)  # [B, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    # Pessimistic bound: on the side where the ratio left the trust region in the
    # advantage's direction, min() picks the constant clipped branch -> zero gradient.
    per_token_loss = -torch.minimum(unclipped * adv, clipped * adv)  # [B, T]
    if importance_weights is not None:
        # Off-policy correction of the samples (TIS), on the policy term only, as TRL does.
        per_token_loss = per_token_loss * importance_weights.detach().to(
            device=device, dtype=cdtype
        )  # [B, T]

    # ---- KL term (computed whenever ref_logps is given, for the stat)
    if ref_logps is not None:
        kl = per_token_kl(logps, ref_logps, valid, estimator=kl_estimator)  # [B, T]
    else:
        kl = torch.zeros(shape, dtype=cdtype, device=device)  # [B, T]
    if beta > 0:
        kl_term = kl  # [B, T]
        if zero_std == "weight":
            # ref 002 option 2: ~0 for groups without reward spread, ~1 above the floor.
            w = torch.sigmoid(
                (group_std.detach().to(device=device, dtype=cdtype) - ZERO_STD_FLOOR) / ZERO_STD_WIDTH
            )  # [B]
            kl_term = kl_term * w.unsqueeze(1)  # [B, T]
        per_token_loss = per_token_loss + beta * kl_term  # [B, T]

    # where(), not multiply, so nothing non-finite at a masked position can leak in.
    per_token_loss = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))  # [B, T]

    # ---- reduction (module docstring); every divisor >= 1 so empty batches give 0
    seqs = float(max(int(num_sequences), 1))
    toks = float(max(int(num_tokens), 1))
    if loss_type == "grpo":
        row_tokens = validf.sum(dim=1).clamp(min=1.0)  # [B]
        row_mean = per_token_loss.sum(dim=1) / row_tokens  # [B]
        loss = row_mean.sum() / seqs  # []
    elif loss_type in ("bnpo", "dapo"):
        loss = per_token_loss.sum() / toks  # []
    else:  # "dr_grpo"
        loss = per_token_loss.sum() / (seqs * float(max(int(max_new_tokens), 1)))  # []

    # ---- stats (detached; means over the tokens entering the loss in this call)
    stats = _loss_stats(ratio, adv, kl, valid, zero_std_flags, eps_low, eps_high, num_generations, cdtype)
    return loss, stats


def _loss_stats(
    ratio: Tensor,
    adv: Tensor,
    kl: Tensor,
    valid: Tensor,
    zero_std_flags: Tensor | None,
    eps_low: float,
    eps_high: float,
    num_generations: int | None,
    cdtype: torch.dtype,
) -> dict[str, Tensor]:
    """grpo_loss's detached stats: ratio [B, T], adv [B, 1], kl [B, T], valid [B, T] bool; means
    over the valid tokens (0 when there are none), in the compute dtype `cdtype`."""
    batch, device = ratio.shape[0], ratio.device
    validf = valid.to(cdtype)  # [B, T]
    with torch.no_grad():
        n_valid = validf.sum()  # []
        denom = n_valid.clamp(min=1.0)  # []
        r = ratio.detach()  # [B, T]
        is_low = (r < 1.0 - eps_low) & (adv < 0) & valid  # [B, T]
        is_high = (r > 1.0 + eps_high) & (adv > 0) & valid  # [B, T]
        if bool(valid.any()):
            ratio_max = r.masked_fill(~valid, float("-inf")).max()  # []
        else:
            ratio_max = torch.zeros((), dtype=cdtype, device=device)
        flags = (
            zero_std_flags.to(device=device, dtype=torch.bool)
            if zero_std_flags is not None
            else torch.zeros(batch, dtype=torch.bool, device=device)
        )  # [B]
        n_zero_rows = flags.sum().to(cdtype)  # []
        stats: dict[str, Tensor] = {
            "kl": (kl.detach() * validf).sum() / denom,
            "clip_ratio/low_mean": is_low.to(cdtype).sum() / denom,
            "clip_ratio/high_mean": is_high.to(cdtype).sum() / denom,
            "clip_ratio/region_mean": (is_low | is_high).to(cdtype).sum() / denom,
            "ratio_mean": (r * validf).sum() / denom,
            "ratio_max": ratio_max,
            "num_tokens": n_valid,
            "num_zero_std_rows": n_zero_rows,
        }
        if num_generations is not None:
            stats["num_zero_std_groups"] = n_zero_rows / float(num_generations)
    return stats
