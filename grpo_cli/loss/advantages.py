"""Advantages and the step's counts: which rows carry a learning signal, and how many sequences and
tokens enter the loss.

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

Counts
------
:func:`loss_normalizers` gives the step totals ``N`` (sequences) and ``M`` (tokens) that the
reductions divide by (``reductions.py``); :func:`_effective_mask` is the one rule of which tokens
enter the loss (under ``zero_std="mask"`` flagged rows leave it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.loss.options import (
    ESTIMATORS,
    SCALE_REWARDS,
    STD_KINDS,
    ZERO_STD_MODES,
    LossConfig,
    _check_choice,
    _compute_dtype,
)


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


def normalize_then_sum(values: Tensor, weights: Tensor, num_generations: int, *, cfg: LossConfig) -> Tensor:
    """GDPO (``loss.multi_objective_aggregation=normalize_then_sum``): each reward normalised within
    its group, then the weighted sum, ``[B]``, which group_advantages then scales as usual.

    TRL 1.16's ``_generate_and_score_completions`` (trl/trainer/grpo_trainer.py, lines 2790-2797):
    ``(r_k - nanmean_group(r_k)) / (nanstd_group(r_k) + 1e-4)``, weighted ``nansum`` over k. Here
    the std is of kind ``cfg.std`` and the epsilon ``cfg.eps`` (grpo-cli's one source for both;
    TRL uses the sample std and 1e-4), and a reward constant in a group (std below
    ``zero_std_threshold``) contributes exactly 0 there. A shaping reward then moves the
    advantages no more than the correctness reward, whatever its scale. TRL follows with a batch
    normalisation; grpo-cli's ``scale_rewards`` applies instead (per group by default).

    Args:
        values: ``[B, R]`` each reward's value, NaN where it gave none (not applicable): such a
            value adds nothing, and the mean and std are over the group's other values.
        weights: ``[R]`` the rewards' weights.
    """
    G = num_generations
    if values.dim() != 2 or tuple(weights.shape) != (values.shape[1],):
        raise ValueError(
            f"values must be [B, R] and weights [R], got {tuple(values.shape)}, {tuple(weights.shape)}"
        )
    v = values.detach().to(_compute_dtype(values.dtype)).view(-1, G, values.shape[1])  # [B/G, G, R]
    present = ~v.isnan()  # [B/G, G, R]
    count = present.sum(dim=1, keepdim=True).clamp(min=1)  # [B/G, 1, R]
    filled = v.nan_to_num(0.0)  # [B/G, G, R]
    mean = filled.sum(dim=1, keepdim=True) / count  # [B/G, 1, R]
    sq = torch.where(present, (v - mean).pow(2), torch.zeros_like(v)).sum(dim=1, keepdim=True)  # [B/G, 1, R]
    denom = (count - 1).clamp(min=1) if cfg.std == "sample" else count  # [B/G, 1, R]
    std = (sq / denom).sqrt()  # [B/G, 1, R]
    normed = torch.where(present, (v - mean) / (std + cfg.eps), torch.zeros_like(v))  # [B/G, G, R]
    normed = torch.where(std < cfg.zero_std_threshold, torch.zeros_like(normed), normed)  # constant: 0
    w = weights.to(device=v.device, dtype=v.dtype)  # [R]
    return (normed * w).sum(dim=-1).reshape(-1)  # [B]


# --------------------------------------------------------------------------- counts


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
