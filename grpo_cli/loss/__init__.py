"""GRPO advantages and loss: pure functions, tensors in, tensors out.

Nothing here knows about models, Hydra or optimizers: the options come as the loss section of
the typed config (``grpo_cli.config.schema.LossConfig``), read by attribute. The training step
computes per-token log-probs, calls :func:`group_advantages` once per rollout,
:func:`loss_normalizers` once per optimizer step, and :func:`grpo_loss` once per micro-batch.
References like ``ref 002`` point at the numbered rules of ``docs/reference.md``.

Shapes: ``B`` rows (completions), ``T`` completion tokens per row (right-padded), ``G``
completions per prompt. Rows arrive in consecutive groups of ``G``.

One module per family, each of pure functions:

* ``advantages.py``: per-group advantages, the zero-std groups (ref 002, ref 004), the
  tokens that enter the loss and the step's counts (``loss_normalizers``), ``has_learning_signal``.
* ``terms.py``: the per-token terms: importance ratio (token or sequence level, GSPO), the
  clipped surrogate, the KL estimators and penalty, the TIS weights.
* ``reductions.py``: the per-token loss to a scalar (per-sequence mean, token mean, constant
  length), each with step-wide denominators (gradient accumulation invariance).
* ``stats.py``: the detached stats of a ``grpo_loss`` call.
* ``options.py``: the allowed values of the other string options, the compute dtype.
* ``variants/``: the loss variants ``loss.loss_type`` chooses, one plug-in module each
  (grpo_cli/plugins.py): ``Variant`` (the policy term and the reduction) is declared there, and
  each module is a built-in named by its file; a user's is chosen by import path, by the same rule.

:func:`variant` is ``loss.loss_type``'s ``Variant`` (built-in or a user's), and :data:`LOSSES`
the built-ins by name, a view of ``variants/``'s modules. A new loss variant is one module in
``variants/`` (its policy term in it, or in ``terms.py``) plus a preset ``conf/loss/<name>.yaml``;
config validation and the error messages take the names from the modules, and ``grpo_loss`` is
the same for every variant.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_cli import plugins
from grpo_cli.loss.advantages import (
    _effective_mask,
    group_advantages,
    has_learning_signal,
    loss_normalizers,
    normalize_then_sum,
    zero_std_groups,
)
from grpo_cli.loss.options import (
    AGGREGATIONS,
    ESTIMATORS,
    IS_LEVELS,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    SAMPLER_CORRECTIONS,
    SCALE_REWARDS,
    STD_KINDS,
    ZERO_STD_MODES,
    LossConfig,
    _check_choice,
    _compute_dtype,
)
from grpo_cli.loss.reductions import Counts
from grpo_cli.loss.stats import loss_stats
from grpo_cli.loss.terms import (
    adapt_entropy_coef,
    applied_entropy_coef,
    clip_range,
    entropy_bonus,
    high_entropy_mask,
    importance_ratio,
    kl_penalty,
    off_policy_mask,
    per_token_kl,
    sequence_mask_weights,
    teacher_term,
    truncated_importance_weights,
)
from grpo_cli.loss.variants import PolicyTerm, Reduction, Variant, VariantStats

__all__ = [
    "group_advantages",
    "zero_std_groups",
    "loss_normalizers",
    "grpo_loss",
    "normalize_then_sum",
    "LossBatch",
    "importance_ratio",
    "adapt_entropy_coef",
    "applied_entropy_coef",
    "per_token_kl",
    "has_learning_signal",
    "truncated_importance_weights",
    "sequence_mask_weights",
    "LOG_RATIO_CLAMP",
    "LOSSES",
    "PolicyTerm",
    "Reduction",
    "Variant",
    "VariantStats",
    "variant",
    "Counts",
    # the allowed values of the other string options (options.py), read by config validation
    "AGGREGATIONS",
    "ESTIMATORS",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "SAMPLER_CORRECTIONS",
    "SCALE_REWARDS",
    "STD_KINDS",
    "ZERO_STD_MODES",
]


#: The package of the loss variants (grpo_cli/plugins.py: a built-in is one of its modules).
VARIANTS = "grpo_cli.loss.variants"


class _Builtins(Mapping[str, Variant]):
    """loss.loss_type's built-in names -> their Variant, in name order: a view of the modules of
    loss/variants/ (found each time, so nothing here lists them)."""

    def __iter__(self) -> Iterator[str]:
        return iter(plugins.builtin_names(VARIANTS))

    def __len__(self) -> int:
        return len(plugins.builtin_names(VARIANTS))

    def __getitem__(self, name: str) -> Variant:
        if name not in plugins.builtin_names(VARIANTS):
            raise KeyError(name)
        return variant(name)


#: The built-in loss variants by name (a view of loss/variants/; ``variant`` takes a user's too).
LOSSES: Mapping[str, Variant] = _Builtins()


@dataclass(frozen=True)
class LossBatch:
    """The tensors of one (micro-)batch that :func:`grpo_loss` reads besides the current-policy
    log-probs: the per-token ones ``[B, T]``, the per-row ones ``[B]`` (None: absent), and the
    group size of its rows."""

    old_logps: Tensor  # [B, T] log-probs of the policy that sampled the batch (ref 000.1)
    advantages: Tensor  # [B] from group_advantages
    mask: Tensor  # [B, T] completion-token mask, 0/1 or bool
    ref_logps: Tensor | None = None  # [B, T] reference-model log-probs (KL), None when beta == 0
    zero_std_flags: Tensor | None = None  # [B] bool from group_advantages; None: no row flagged
    group_std: Tensor | None = None  # [B] per-row group std; zero_std="weight" needs it
    importance_weights: Tensor | None = None  # [B, T] per-token weights of the policy term (TIS)
    sampler_logps: Tensor | None = None  # [B, T] the sampler's log-probs (off_policy_mask_threshold)
    teacher_logps: Tensor | None = None  # [B, T] the teacher's log-probs of the tokens (teacher_kl)
    num_generations: int | None = None  # G, only for the num_zero_std_groups stat


def grpo_loss(
    logps: Tensor,
    batch: LossBatch,
    *,
    cfg: LossConfig,
    counts: Counts | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The ``loss_type`` variant's policy term plus ``beta * KL``, reduced by its reduction.

    Args:
        logps: ``[B, T]`` current-policy log-probs of the completion tokens
            (with gradient). Values at masked positions may be garbage.
        batch: the other tensors (:class:`LossBatch`): ``old_logps`` (detached here),
            ``ref_logps`` (for KL, not for the ratio; None when ``beta == 0``), ``advantages``
            (detached here), ``mask``, ``zero_std_flags``, ``group_std`` (required by
            ``zero_std="weight"``), ``importance_weights`` (optional ``[B, T]`` weights of the
            policy term, not the KL term, e.g. :func:`truncated_importance_weights` for a
            sampler/trainer mismatch; detached here) and ``num_generations`` (only used for the
            ``num_zero_std_groups`` stat).
        cfg: the loss section; read: ``loss_type`` (:func:`variant`), ``beta`` (>= 0),
            ``epsilon``/``epsilon_high``/``delta`` (the clipped surrogate's range, ``terms.py``),
            ``importance_sampling_level`` (``"token"`` or ``"sequence"``, GSPO),
            ``kl_estimator`` (``"k1"``, ``"k2"``, ``"k3"``), ``zero_std`` (``"mask"``,
            ``"weight"``, ``"keep"``, ref 002).
        entropy: ``[B, T]`` the current policy's per-token entropy, with its gradient where
            ``cfg.entropy_coef > 0`` (the entropy bonus: ``- entropy_coef * mean H`` over the
            tokens in the loss, less the rows of zero-std groups: ref 002, no gradient there in
            any zero_std mode); ``top_entropy_quantile < 1`` keeps only the high-entropy tokens
            in the policy term and the bonus (:func:`high_entropy_mask`). Needed by either.
        counts: the step's divisors (:class:`Counts`): ``num_sequences`` and ``num_tokens`` from
            :func:`loss_normalizers`, and ``max_new_tokens`` (``L`` for ``"dr_grpo"``: the
            configured completion limit, as micro-batches are padded to different lengths).
            None: this call's own counts and ``L = T``.

    Returns:
        ``(loss, stats)``: a scalar loss, and detached scalar stats ``kl``,
        ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean``, ``ratio_mean``, ``ratio_max``,
        ``num_tokens``, ``num_zero_std_rows`` and, when ``num_generations``
        is given, ``num_zero_std_groups``. Means are over the tokens that enter
        the loss in this call (0 when there are none).
    """
    b = batch
    old_logps, ref_logps, advantages, mask = b.old_logps, b.ref_logps, b.advantages, b.mask
    zero_std_flags, group_std, importance_weights = b.zero_std_flags, b.group_std, b.importance_weights
    variant = _check_options(cfg, ref_logps, group_std, entropy, b.sampler_logps, b.teacher_logps)
    tokens = dict(
        old_logps=old_logps,
        ref_logps=ref_logps,
        mask=mask,
        importance_weights=importance_weights,
        sampler_logps=b.sampler_logps,
        teacher_logps=b.teacher_logps,
    )
    rows = dict(advantages=advantages, zero_std_flags=zero_std_flags, group_std=group_std)
    _check_shapes(logps, tokens, rows)
    cdtype, device = _compute_dtype(logps.dtype), logps.device
    valid = _effective_mask(mask, zero_std_flags, cfg.zero_std)  # [B, T] bool: tokens in the loss
    if counts is None:
        counts = Counts(*loss_normalizers(mask, zero_std_flags, zero_std_mode=cfg.zero_std), logps.shape[1])

    adv = advantages.detach().to(device=device, dtype=cdtype).unsqueeze(1)  # [B, 1]
    ratio = importance_ratio(logps, old_logps, valid, level=cfg.importance_sampling_level)  # [B, T]
    per_token_loss = _policy_loss(variant, ratio, adv, cfg, importance_weights)  # [B, T]
    top = cfg.top_entropy_quantile < 1.0
    high = high_entropy_mask(entropy, valid, cfg.top_entropy_quantile) if top else valid  # [B, T]
    if top:  # the 80/20 rule: the policy term on the high-entropy tokens only (TRL: before the KL)
        per_token_loss = per_token_loss * high
    kept_rows = None
    if cfg.off_policy_mask_threshold is not None:  # DeepSeek-V3.2: drop far-off-policy bad sequences
        kept_rows = off_policy_mask(
            logps, b.sampler_logps, adv, valid, cfg.off_policy_mask_threshold
        )  # [B, 1]
        per_token_loss = per_token_loss * kept_rows
    kl = _kl(logps, ref_logps, valid, cfg)  # [B, T]
    if cfg.beta > 0:
        per_token_loss = per_token_loss + kl_penalty(kl, cfg, group_std)  # [B, T]
    # where(), not multiply, so nothing non-finite at a masked position can leak in.
    per_token_loss = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))  # [B, T]

    loss = variant.reduce(per_token_loss, valid, counts)  # []
    if cfg.entropy_coef:
        rows = zero_std_flags if zero_std_flags is not None else torch.zeros(logps.shape[0], dtype=torch.bool)
        keep = high & ~rows.to(device=device, dtype=torch.bool).unsqueeze(1)  # [B, T]
        loss = loss + entropy_bonus(entropy, keep, cfg.entropy_coef, counts.num_tokens)  # []
    teacher_stats: dict[str, Tensor] = {}
    if cfg.teacher_kl:  # on-policy distillation: every trained token, zero-std rows included
        term, teacher_stats = _teacher(logps, old_logps, b, cfg, counts)
        loss = loss + term
    stats = loss_stats(ratio, adv, kl, valid, zero_std_flags, clip_range(cfg), b.num_generations)
    stats.update(teacher_stats)
    if kept_rows is not None:  # the share of the tokens in the loss whose sequence the mask dropped
        stats["off_policy_mask/masked"] = _masked_mean((~kept_rows).to(ratio.dtype).expand_as(ratio), valid)
    if variant.stats is not None:  # the variant's own: means over the tokens in the loss
        for name, per_token in variant.stats(ratio, adv, cfg).items():
            stats[name] = _masked_mean(per_token.to(ratio.dtype), valid)
    return loss, stats


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """The detached mean of x [B, T] over the True positions of mask [B, T] (0 with none)."""
    m = mask.to(x.dtype)
    return (x.detach() * m).sum() / m.sum().clamp(min=1.0)


def _teacher(logps: Tensor, old_logps: Tensor, b: LossBatch, cfg: LossConfig, counts: Counts):
    """On-policy distillation's term [] (terms.teacher_term) over every trained token of the batch,
    and its stats: teacher/kl (the k1 mean, KL(policy || teacher)) and teacher/logp (the teacher's
    mean log-prob of the sampled tokens), means over the trained tokens."""
    trained = b.mask != 0  # [B, T]
    all_tokens = counts.all_tokens if counts.all_tokens is not None else int(trained.sum())
    # The token-level ratio, whatever importance_sampling_level the policy term uses.
    token_ratio = importance_ratio(logps, old_logps, trained)  # [B, T]
    term = teacher_term(logps, b.teacher_logps, token_ratio, trained, cfg.teacher_kl, all_tokens)
    t_logps = b.teacher_logps.detach().to(token_ratio.dtype)  # [B, T]
    k1 = logps.detach().to(token_ratio.dtype) - t_logps  # [B, T]
    return term, {"teacher/kl": _masked_mean(k1, trained), "teacher/logp": _masked_mean(t_logps, trained)}


def _check_options(
    cfg: LossConfig,
    ref_logps: Tensor | None,
    group_std: Tensor | None,
    entropy: Tensor | None,
    b_sampler_logps: Tensor | None,
    teacher_logps: Tensor | None = None,
) -> Variant:
    """grpo_loss's option checks; the variant ``cfg.loss_type`` names."""
    beta, zero_std = cfg.beta, cfg.zero_std
    if cfg.teacher_kl and teacher_logps is None:
        raise ValueError("teacher_kl > 0 needs the teacher's log-probs (LossBatch.teacher_logps)")
    if cfg.off_policy_mask_threshold is not None and b_sampler_logps is None:
        raise ValueError("off_policy_mask_threshold needs the sampler's log-probs (LossBatch.sampler_logps)")
    if (cfg.entropy_coef or cfg.top_entropy_quantile < 1.0) and entropy is None:
        raise ValueError(
            "entropy_coef > 0 or top_entropy_quantile < 1 needs the entropy (grpo_loss(entropy=...))"
        )
    _check_choice("importance_sampling_level", cfg.importance_sampling_level, IS_LEVELS)
    _check_choice("kl_estimator", cfg.kl_estimator, KL_ESTIMATORS)
    try:
        chosen = variant(cfg.loss_type)
    except ValueError:  # a built-in name: the names registered, as the other options list theirs
        if not plugins.is_import_path(cfg.loss_type):
            _check_choice("loss_type", cfg.loss_type, tuple(LOSSES))
        raise
    _check_choice("zero_std", zero_std, ZERO_STD_MODES)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logps (reference-model log-probs)")
    if zero_std == "weight" and group_std is None:
        raise ValueError("zero_std='weight' needs group_std (from group_advantages)")
    return chosen


@functools.cache
def variant(name: str) -> Variant:
    """``loss.loss_type``'s Variant: what the PLUGIN of the module ``name`` names builds, a module
    of loss/variants/ (``grpo``) or a user's by import path (``my_pkg.my_loss``: a module declaring
    ``PLUGIN = Plugin(name=..., build=lambda: Variant(...))``), one rule for both (plugins.load).
    ValueError otherwise, naming the built-ins."""
    try:
        made = plugins.load(VARIANTS, name, "loss.loss_type").build()
    except plugins.UserError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(made, Variant):
        raise ValueError(
            f"loss.loss_type={name!r}: its PLUGIN's build() returned {type(made).__name__}, not a "
            "grpo_cli.loss.Variant(policy_term=..., reduce=...)."
        )
    return made


def _check_shapes(logps: Tensor, tokens: dict[str, Tensor | None], rows: dict[str, Tensor | None]) -> None:
    """``logps`` is ``[B, T]``; each tensor of ``tokens`` has its shape, each of ``rows`` is
    ``[B]`` (None: absent)."""
    if logps.dim() != 2:
        raise ValueError(f"logps must be [B, T], got shape {tuple(logps.shape)}")
    shape = tuple(logps.shape)
    for name, t in tokens.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have the shape of logps {shape}, got {tuple(t.shape)}")
    for name, t in rows.items():
        if t is not None and tuple(t.shape) != (shape[0],):
            raise ValueError(f"{name} must be [B]=({shape[0]},), got {tuple(t.shape)}")


def _policy_loss(
    variant: Variant, ratio: Tensor, adv: Tensor, cfg: LossConfig, importance_weights: Tensor | None
) -> Tensor:
    """The variant's policy term ``[B, T]``, times the TIS weights when given."""
    per_token_loss = variant.policy_term(ratio, adv, cfg)  # [B, T]
    if importance_weights is not None:
        # Off-policy correction of the samples (TIS), on the policy term only, as TRL does.
        per_token_loss = per_token_loss * importance_weights.detach().to(
            device=ratio.device, dtype=ratio.dtype
        )  # [B, T]
    return per_token_loss


def _kl(logps: Tensor, ref_logps: Tensor | None, valid: Tensor, cfg: LossConfig) -> Tensor:
    """The per-token KL ``[B, T]``, computed whenever ``ref_logps`` is given (for the stat, even
    when ``beta == 0``); zeros without a reference."""
    if ref_logps is not None:
        return per_token_kl(logps, ref_logps, valid, estimator=cfg.kl_estimator)  # [B, T]
    return torch.zeros(tuple(logps.shape), dtype=_compute_dtype(logps.dtype), device=logps.device)  # [B, T]
