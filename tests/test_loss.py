"""Tests for grpo_cli.loss.

Each test names the reference rule it locks (docs/reference.md):
000.1 ratio against itself, 000.6 reductions / std kind, 000.8 numeric self-check,
002 zero-std groups and spurious KL, 004 per-group advantages / clipping / k3 KL.
Gradient comparisons run in float64.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from grpo_cli import loss as loss_module
from grpo_cli.config import LossConfig
from grpo_cli.loss import (
    LOG_RATIO_CLAMP,
    Counts,
    LossBatch,
    has_learning_signal,
    importance_ratio,
    loss_normalizers,
    per_token_kl,
    truncated_importance_weights,
)

_OPTIONS = {f.name for f in fields(LossConfig)}


def _split(kw: dict) -> tuple[LossConfig, dict]:
    """The loss options among `kw` as the config section the functions take, and the rest."""
    return LossConfig(**{k: v for k, v in kw.items() if k in _OPTIONS}), {
        k: v for k, v in kw.items() if k not in _OPTIONS
    }


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, **kw):
    """loss.grpo_loss with the tables' options (beta=..., loss_type=...) given as its cfg, the
    other tensors (zero_std_flags=..., num_generations=...) as its LossBatch, and the step's
    num_sequences, num_tokens (and max_new_tokens: T unless given) as its Counts."""
    cfg, rest = _split(kw)
    n_seq, n_tok, L, all_tok = (
        rest.pop(k, None) for k in ("num_sequences", "num_tokens", "max_new_tokens", "all_tokens")
    )
    counts = None if n_seq is None else Counts(n_seq, n_tok, logps.shape[1] if L is None else L, all_tok)
    entropy = rest.pop("entropy", None)
    batch = LossBatch(old_logps, advantages, mask, ref_logps, **rest)
    return loss_module.grpo_loss(logps, batch, cfg=cfg, counts=counts, entropy=entropy)


def group_advantages(rewards, num_generations, **kw):
    cfg, rest = _split(kw)
    return loss_module.group_advantages(rewards, num_generations, cfg=cfg, **rest)


F64 = torch.float64
LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"]
LEVELS = ["token", "sequence"]
ZERO_STD_MODES = ["mask", "weight", "keep"]


# --------------------------------------------------------------------------- helpers


def lengths_mask(lengths, seq_len):
    """[B, T] float mask, right padding: row i has lengths[i] valid tokens."""
    ar = torch.arange(seq_len).unsqueeze(0)  # [1, T]
    return (ar < torch.tensor(lengths).unsqueeze(1)).to(F64)  # [B, T]


def make_batch(lengths, seq_len, seed=0):
    """Random log-probs; old and ref near the policy so ratios stay inside the clip range."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    logps = -torch.rand(b, seq_len, generator=g, dtype=F64) * 3.0 - 0.1  # [B, T]
    old = logps + 0.05 * torch.randn(b, seq_len, generator=g, dtype=F64)  # [B, T]
    ref = logps + 0.3 * torch.randn(b, seq_len, generator=g, dtype=F64)  # [B, T]
    mask = lengths_mask(lengths, seq_len)  # [B, T]
    return logps, old, ref, mask


def grad_of(logps, *args, **kwargs):
    """(loss, grad wrt logps, stats) for one grpo_loss call on a fresh leaf."""
    leaf = logps.detach().clone().requires_grad_(True)
    loss, stats = grpo_loss(leaf, *args, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad.detach(), stats


def batch_wide_advantages(rewards, eps=1e-4):
    """The WRONG normalisation ref 004 warns about: mean/std over the whole batch."""
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize(
    "estimator,scale",
    [("grpo", "group"), ("grpo", "none"), ("rloo", "group"), ("rloo", "none")],
    ids=["grpo-group", "grpo-none", "rloo-group", "rloo-none"],
)
def test_advantages_are_per_group(estimator, scale):
    """ref 004: changing one group's rewards leaves every other group's advantages unchanged."""
    g = 4
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.2, 0.9, 0.4, 0.1, 3.0, 1.0, 2.0, 5.0])  # [B]
    changed = rewards.clone()
    changed[4:8] = torch.tensor([10.0, -7.0, 2.0, 8.0])  # only group 1 differs
    a, _, _ = group_advantages(rewards, g, estimator=estimator, scale_rewards=scale)
    b, _, _ = group_advantages(changed, g, estimator=estimator, scale_rewards=scale)
    others = torch.tensor([1] * 4 + [0] * 4 + [1] * 4, dtype=torch.bool)
    assert torch.equal(a[others], b[others])
    assert not torch.equal(a[~others], b[~others])
    # The batch-wide version fails the same property.
    wa, wb = batch_wide_advantages(rewards), batch_wide_advantages(changed)
    assert not torch.allclose(wa[others], wb[others])


def test_advantages_detached_and_both_signs():
    """ref 004 (detached constants) and ref 000.8 (advantages of both signs)."""
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25, 1.0, 1.0, 1.0, 1.0], requires_grad=True)
    adv, zero, gstd = group_advantages(rewards, 4)
    for t in (adv, zero, gstd):
        assert not t.requires_grad and t.grad_fn is None
    assert (adv[:4] > 0).any() and (adv[:4] < 0).any()
    assert adv.dtype == torch.float32 and zero.dtype == torch.bool


@pytest.mark.parametrize(
    "estimator,scale,std",
    [
        ("grpo", "group", "population"),
        ("grpo", "group", "sample"),
        ("grpo", "batch", "population"),
        ("grpo", "none", "population"),
        ("rloo", "group", "sample"),
        ("rloo", "none", "population"),
    ],
    ids=["grpo-group-pop", "grpo-group-sample", "grpo-batch", "grpo-none", "rloo-group", "rloo-none"],
)
def test_zero_std_groups_get_exactly_zero(estimator, scale, std):
    """ref 002: groups below the std threshold are flagged and get advantages exactly 0."""
    rewards = torch.tensor(
        [1.0, 1.0, 1.0, 1.0, 0.3, 0.3 + 1e-8, 0.3, 0.3, 0.0, 1.0, 0.0, 1.0], dtype=F64
    )  # group 0 constant, group 1 below threshold, group 2 with signal
    adv, zero, gstd = group_advantages(rewards, 4, estimator=estimator, scale_rewards=scale, std=std)
    assert zero.tolist() == [True] * 8 + [False] * 4
    assert torch.equal(adv[:8], torch.zeros(8, dtype=F64))
    assert (adv[8:] != 0).all()
    assert (gstd[:8] < 1e-6).all() and (gstd[8:] > 0.4).all()


@pytest.mark.parametrize("k", [2, 3, 5], ids=["K2", "K3", "K5"])
def test_rloo_is_leave_one_out(k):
    """ref 004: RLOO advantage = r_i - mean(others) = K/(K-1) * (r_i - mean(group))."""
    g = torch.Generator().manual_seed(k)
    rewards = torch.rand(3 * k, generator=g, dtype=F64)  # [B]
    adv, _, _ = group_advantages(rewards, k, estimator="rloo", scale_rewards="none")
    grouped = rewards.view(-1, k)  # [B/K, K]
    closed = (k / (k - 1) * (grouped - grouped.mean(1, keepdim=True))).reshape(-1)  # [B]
    loop = []
    for row in grouped:
        for i in range(k):
            others = torch.cat([row[:i], row[i + 1 :]])
            loop.append(row[i] - others.mean())
    assert torch.allclose(adv, closed)
    assert torch.allclose(adv, torch.stack(loop))


@pytest.mark.parametrize(
    "std,expected_adv,expected_std",
    [("population", 1.0, 0.5), ("sample", 1 / math.sqrt(2), 1 / math.sqrt(2))],
    ids=["population", "sample"],
)
def test_population_vs_sample_std_g2(std, expected_adv, expected_std):
    """ref 000.6: with G=2, rewards {0,1}: population std gives +-1, sample std +-0.707."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=F64)
    adv, _, gstd = group_advantages(rewards, 2, std=std, eps=0.0)
    sign = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=F64)
    assert torch.allclose(adv, expected_adv * sign)
    assert torch.allclose(gstd, torch.full((4,), expected_std, dtype=F64))
    if std == "population":  # unit RMS per group
        assert torch.allclose(adv.view(-1, 2).pow(2).mean(1), torch.ones(2, dtype=F64))


@pytest.mark.parametrize("scale", ["batch", "none", "group"], ids=["batch", "none", "group"])
def test_scale_rewards_values(scale):
    """ref 004: mean always per group; the divisor is group std, batch std, or none."""
    rewards = torch.tensor([0.0, 2.0, 10.0, 14.0], dtype=F64)
    eps = 1e-4
    adv, _, _ = group_advantages(rewards, 2, scale_rewards=scale, eps=eps)
    centered = torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=F64)
    if scale == "none":
        expected = centered
    elif scale == "batch":
        expected = centered / (rewards.std(unbiased=False) + eps)
    else:
        expected = centered / (torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=F64) + eps)
    assert torch.allclose(adv, expected)


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float64],
    ids=["bf16", "fp16", "fp32", "fp64"],
)
def test_advantages_dtype(dtype):
    """Advantages are computed in float32 or wider whatever the reward dtype."""
    adv, _, gstd = group_advantages(torch.tensor([0.0, 1.0], dtype=dtype), 2)
    assert adv.dtype == gstd.dtype == torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------- normalisers


def test_loss_normalizers_counts():
    """ref 000.8 (valid-token count) and ref 002 (masked zero-std rows leave the count)."""
    mask = lengths_mask([3, 0, 2, 4], 4)
    zero = torch.tensor([False, False, True, True])
    assert loss_normalizers(mask) == (3, 9)
    assert loss_normalizers(mask, zero) == (1, 3)
    assert loss_normalizers(mask, zero, zero_std_mode="keep") == (3, 9)
    assert loss_normalizers(mask, zero, zero_std_mode="weight") == (3, 9)
    assert loss_normalizers(mask.bool(), zero) == (1, 3)


# --------------------------------------------------------------------------- ratio == 1


def expected_onpolicy_grad(adv, mask, loss_type):
    """Hand-derived d loss / d logp at ratio 1 (policy term only): -A_i * d(reduction)/d(logp)."""
    n_i = mask.sum(1, keepdim=True)  # [B, 1]
    n_seq = (n_i > 0).sum()
    n_tok = mask.sum()
    a = adv.unsqueeze(1)  # [B, 1]
    if loss_type in ("grpo", "sapo"):
        w = 1.0 / (n_i.clamp(min=1) * n_seq)
    elif loss_type in ("bnpo", "dapo", "cispo"):
        w = 1.0 / n_tok
    else:
        w = 1.0 / (n_seq * mask.shape[1])
    return -a * w * mask  # [B, T]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_onpolicy_ratio_one_and_gradient(loss_type, level):
    """ref 000.1 / 000.8: with old = detached copy the ratio is exactly 1 and the
    gradient is -A * d(reduction)/d(logp) (grpo: -A_i / (n_i * N))."""
    logps, _, _, mask = make_batch([5, 2, 4, 1], 5)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    old = logps.detach().clone()
    ratio = importance_ratio(logps, old, mask, level=level)
    assert torch.equal(ratio, torch.ones_like(ratio))
    _, grad, stats = grad_of(
        logps, old, None, adv, mask, loss_type=loss_type, importance_sampling_level=level
    )
    assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["num_tokens"].item() == 12
    assert torch.allclose(grad, expected_onpolicy_grad(adv, mask, loss_type))


def test_old_logps_from_same_forward_pass_still_has_gradient():
    """ref 000.1: old_logps are detached inside, so passing the live tensor by mistake
    gives the on-policy gradient instead of a silent zero."""
    logps, _, _, mask = make_batch([3, 3], 3)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    leaf = logps.clone().requires_grad_(True)
    loss, _ = grpo_loss(leaf, leaf, None, adv, mask)
    loss.backward()
    assert torch.allclose(leaf.grad, expected_onpolicy_grad(adv, mask, "grpo"))


# --------------------------------------------------------------------------- KL


def test_k3_nonnegative_and_zero_at_reference():
    """ref 004: k3 = exp(x) - x - 1 >= 0 everywhere, == 0 when policy == reference."""
    g = torch.Generator().manual_seed(1)
    for dtype, scale in ((torch.float32, 1e-4), (torch.float32, 1.0), (torch.float32, 50.0), (F64, 5.0)):
        lp = torch.randn(64, 33, generator=g).to(dtype) * scale
        ref = torch.randn(64, 33, generator=g).to(dtype) * scale
        assert (per_token_kl(lp, ref) >= 0).all()
        assert torch.isfinite(per_token_kl(lp, ref)).all()
        assert torch.equal(per_token_kl(lp, lp), torch.zeros_like(lp))


@pytest.mark.parametrize(
    "estimator,formula",
    [
        ("k1", lambda lp, ref: lp - ref),
        ("k2", lambda lp, ref: 0.5 * (ref - lp) ** 2),
        ("k3", lambda lp, ref: torch.exp(ref - lp) - (ref - lp) - 1),
    ],
    ids=["k1", "k2", "k3"],
)
def test_kl_estimator_formulas(estimator, formula):
    """ref 004: KL estimators with x = ref_logp - logp; the 'kl' stat is their token mean."""
    logps, _, ref, mask = make_batch([4, 2], 4, seed=3)
    kl = per_token_kl(logps, ref, estimator=estimator)
    assert torch.allclose(kl, formula(logps, ref))
    _, stats = grpo_loss(logps, logps, ref, torch.zeros(2, dtype=F64), mask, beta=0.1, kl_estimator=estimator)
    expected_mean = (formula(logps, ref) * mask).sum() / mask.sum()
    assert torch.allclose(stats["kl"], expected_mean)


# --------------------------------------------------------------------------- zero-std groups


def zero_std_setup():
    """Two groups of G=2: group 0 has signal, group 1 has constant rewards (zero std)."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=F64)
    adv, zero, gstd = group_advantages(rewards, 2)
    logps, old, ref, mask = make_batch([4, 3, 4, 2], 4, seed=7)
    return logps, old, ref, mask, adv, zero, gstd


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_mask_mode_zero_std_group_has_zero_gradient(loss_type):
    """ref 002 option 1: under 'mask' a zero-std group contributes exactly zero gradient
    (policy and KL) and the other rows' gradients equal a batch without that group."""
    logps, old, ref, mask, adv, zero, gstd = zero_std_setup()
    kw = dict(beta=0.04, loss_type=loss_type, zero_std="mask")
    loss, grad, stats = grad_of(logps, old, ref, adv, mask, zero_std_flags=zero, **kw)
    assert torch.equal(grad[2:], torch.zeros_like(grad[2:]))
    loss_s, grad_s, _ = grad_of(logps[:2], old[:2], ref[:2], adv[:2], mask[:2], zero_std_flags=zero[:2], **kw)
    assert torch.allclose(loss, loss_s)
    assert torch.allclose(grad[:2], grad_s)
    assert stats["num_zero_std_rows"].item() == 2


def test_keep_mode_zero_std_group_gets_kl_gradient():
    """ref 002 (the bug, kept for comparison): under 'keep' the zero-std group's KL still
    moves its tokens although its advantages are 0."""
    logps, old, ref, mask, adv, zero, gstd = zero_std_setup()
    _, grad, _ = grad_of(logps, old, ref, adv, mask, beta=0.04, zero_std="keep", zero_std_flags=zero)
    _, grad0, _ = grad_of(logps, old, ref, adv, mask, beta=0.0, zero_std="keep", zero_std_flags=zero)
    assert torch.equal(grad0[2:], torch.zeros_like(grad0[2:]))  # no policy signal
    assert (grad[2:] * mask[2:]).abs().sum() > 0  # spurious KL gradient


@pytest.mark.parametrize("mode", ZERO_STD_MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_signal_group_gets_policy_and_kl_gradient(mode, loss_type):
    """ref 002 invariant: a group with reward signal keeps policy AND KL gradient in every mode."""
    logps, old, ref, mask, adv, zero, gstd = zero_std_setup()
    kw = dict(loss_type=loss_type, zero_std=mode, zero_std_flags=zero, group_std=gstd)
    _, g_pol, _ = grad_of(logps, old, ref, adv, mask, beta=0.0, **kw)
    _, g_all, _ = grad_of(logps, old, ref, adv, mask, beta=0.04, **kw)
    valid = mask[:2].bool()
    assert (g_pol[:2][valid] != 0).all()
    assert ((g_all - g_pol)[:2][valid] != 0).all()


@pytest.mark.parametrize("std_value", [0.0, 0.05, 0.06, 0.5], ids=["std0", "floor", "floor+width", "std.5"])
def test_weight_mode_scales_kl_by_sigmoid(std_value):
    """ref 002 option 2: under 'weight' each row's KL gradient is the 'keep' KL gradient
    times sigmoid((group_std - floor) / width)."""
    logps, old, ref, mask, _, _, _ = zero_std_setup()
    adv = torch.zeros(4, dtype=F64)  # isolate the KL term
    gstd = torch.full((4,), std_value, dtype=F64)
    _, g_keep, _ = grad_of(logps, old, ref, adv, mask, beta=0.1, zero_std="keep")
    _, g_w, _ = grad_of(
        logps,
        old,
        ref,
        adv,
        mask,
        beta=0.1,
        zero_std="weight",
        group_std=gstd,
    )
    w = torch.sigmoid(torch.tensor((std_value - 0.05) / 0.01, dtype=F64))
    assert torch.allclose(g_w, w * g_keep)
    if std_value == 0.05:
        assert torch.isclose(w, torch.tensor(0.5, dtype=F64))


# --------------------------------------------------------------------------- clipping


@pytest.mark.parametrize(
    "adv,ratio,eps,eps_high,has_grad,stat",
    [
        (1.0, 1.30, 0.2, None, False, "high"),  # A>0, above 1+eps: clipped
        (1.0, 0.70, 0.2, None, True, None),  # A>0, below 1-eps: unclipped side
        (-1.0, 0.70, 0.2, None, False, "low"),  # A<0, below 1-eps: clipped
        (-1.0, 1.30, 0.2, None, True, None),  # A<0, above 1+eps: unclipped side
        (1.0, 1.25, 0.2, 0.28, True, None),  # clip-higher: 1.25 < 1.28 still learns
        (1.0, 1.30, 0.2, 0.28, False, "high"),  # beyond 1+eps_high: clipped
        (-1.0, 0.75, 0.2, 0.28, False, "low"),  # low bound still uses eps
        (1.0, 1.10, 0.2, None, True, None),  # inside the trust region
    ],
    ids=[
        "pos-high-clip",
        "pos-low-free",
        "neg-low-clip",
        "neg-high-free",
        "asym-1.25-free",
        "asym-1.30-clip",
        "asym-low-clip",
        "inside",
    ],
)
def test_clipping_gradient(adv, ratio, eps, eps_high, has_grad, stat):
    """ref 004 clipped surrogate (DAPO clip-higher): the clipped side gets zero gradient,
    the unclipped side keeps it; the clip-ratio stats count the clipped tokens."""
    logps = torch.zeros(1, 2, dtype=F64)
    old = torch.full((1, 2), -math.log(ratio), dtype=F64)  # ratio = exp(0 - old)
    mask = torch.ones(1, 2, dtype=F64)
    a = torch.tensor([adv], dtype=F64)
    _, grad, stats = grad_of(logps, old, None, a, mask, epsilon=eps, epsilon_high=eps_high, loss_type="bnpo")
    if has_grad:
        assert torch.allclose(grad, torch.full_like(grad, -adv * ratio / 2))
    else:
        assert torch.equal(grad, torch.zeros_like(grad))
    assert stats["clip_ratio/high_mean"].item() == (1.0 if stat == "high" else 0.0)
    assert stats["clip_ratio/low_mean"].item() == (1.0 if stat == "low" else 0.0)
    assert stats["clip_ratio/region_mean"].item() == (1.0 if stat else 0.0)
    assert math.isclose(stats["ratio_max"].item(), ratio)


def test_sequence_level_ratio_constant_along_row():
    """GSPO: one ratio per row, exp(mean of the row's valid log-ratios), broadcast along T."""
    logps, old, _, mask = make_batch([5, 3, 1, 0], 5, seed=11)
    ratio = importance_ratio(logps, old, mask, level="sequence")
    n = mask.sum(1).clamp(min=1)
    expected = torch.exp(((logps - old) * mask).sum(1) / n)  # [B]
    assert torch.allclose(ratio, expected.unsqueeze(1).expand_as(ratio))
    assert torch.equal(ratio[3], torch.ones(5, dtype=F64))  # empty row: ratio 1


def test_delta_caps_the_unclipped_ratio():
    """TRL two-sided clipping: with delta set, the unclipped branch uses min(r, delta)."""
    logps = torch.zeros(1, 1, dtype=F64)
    old = torch.full((1, 1), -math.log(5.0), dtype=F64)  # r = 5
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.tensor([-1.0], dtype=F64)  # A<0, r high: unclipped side, loss = r
    loss, grad, _ = grad_of(logps, old, None, a, mask)
    assert math.isclose(loss.item(), 5.0) and grad.item() != 0
    loss, grad, _ = grad_of(logps, old, None, a, mask, delta=2.0)
    assert math.isclose(loss.item(), 2.0) and grad.item() == 0


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("mode", ZERO_STD_MODES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_accumulation_invariance(loss_type, level, mode):
    """ref 000.6: with step totals from loss_normalizers, four 2-row micro-batches sum to
    the loss and gradient of one 8-row call (rows of different lengths, a zero-std group)."""
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 0.0, 0.3, 0.9], dtype=F64)
    adv, zero, gstd = group_advantages(rewards, 2)
    assert zero.tolist() == [False, False, True, True, False, False, False, False]
    logps, old, ref, mask = make_batch([6, 1, 4, 6, 3, 0, 5, 2], 6, seed=5)
    old = old + 0.3 * torch.randn(8, 6, dtype=F64, generator=torch.Generator().manual_seed(9))
    kw = dict(
        beta=0.04, loss_type=loss_type, importance_sampling_level=level, zero_std=mode, num_generations=2
    )
    full_loss, full_grad, _ = grad_of(logps, old, ref, adv, mask, zero_std_flags=zero, group_std=gstd, **kw)
    n_seq, n_tok = loss_normalizers(mask, zero, zero_std_mode=mode)
    leaf = logps.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for s in range(0, 8, 2):
        sl = slice(s, s + 2)
        loss, _ = grpo_loss(
            leaf[sl],
            old[sl],
            ref[sl],
            adv[sl],
            mask[sl],
            zero_std_flags=zero[sl],
            group_std=gstd[sl],
            num_sequences=n_seq,
            num_tokens=n_tok,
            **kw,
        )
        loss.backward()
        total = total + loss.detach()
    assert torch.allclose(total, full_loss)
    assert torch.allclose(leaf.grad, full_grad)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_duplicated_batch_same_loss(loss_type, level):
    """ref 000.6: no hard-coded batch size; torch.cat([x, x]) leaves every loss unchanged."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.2, 0.7], dtype=F64)
    adv, zero, gstd = group_advantages(rewards, 2)
    logps, old, ref, mask = make_batch([3, 1, 4, 2, 4, 0], 4, seed=2)
    kw = dict(beta=0.04, loss_type=loss_type, importance_sampling_level=level)
    loss, _ = grpo_loss(logps, old, ref, adv, mask, zero_std_flags=zero, **kw)
    d = lambda x: torch.cat([x, x])  # noqa: E731
    adv2, zero2, _ = group_advantages(d(rewards), 2)
    assert torch.equal(adv2, d(adv))
    loss2, _ = grpo_loss(d(logps), d(old), d(ref), adv2, d(mask), zero_std_flags=zero2, **kw)
    assert torch.allclose(loss, loss2)


# --------------------------------------------------------------------------- robustness


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_finite_with_masked_garbage_and_extreme_logps(loss_type, level, kl_estimator):
    """ref 000.8: finite loss and gradients with fully masked rows, inf/NaN garbage at
    masked positions and extreme log-probs (-1e4) at valid ones."""
    logps, old, ref, mask = make_batch([4, 0, 2, 3], 4, seed=4)
    logps = logps.float()
    old, ref, mask = old.float(), ref.float(), mask.bool()
    logps[0, 1] = -1e4  # valid, extreme
    ref[2, 0] = -1e4
    old[3, 2] = -1e4
    logps[~mask] = -float("inf")
    old[~mask] = float("inf")
    ref[~mask] = float("nan")
    logps[1, 0] = float("nan")
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    leaf = logps.clone().requires_grad_(True)
    loss, stats = grpo_loss(
        leaf,
        old,
        ref,
        adv,
        mask,
        beta=0.04,
        loss_type=loss_type,
        importance_sampling_level=level,
        kl_estimator=kl_estimator,
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(leaf.grad).all()
    assert torch.equal(leaf.grad[~mask], torch.zeros_like(leaf.grad[~mask]))
    assert all(torch.isfinite(v) for v in stats.values())
    assert stats["ratio_max"].item() <= math.exp(LOG_RATIO_CLAMP) * (1 + 1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("flagged", [False, True], ids=["mask-zero", "all-rows-zero-std"])
def test_all_masked_batch_gives_zero(loss_type, flagged):
    """ref 000.8: an empty batch (no valid tokens, or every row a masked zero-std row)
    gives a finite 0 loss, zero gradients and finite stats."""
    logps = torch.randn(3, 4, dtype=F64)
    mask = torch.ones(3, 4, dtype=F64) if flagged else torch.zeros(3, 4, dtype=F64)
    flags = torch.ones(3, dtype=torch.bool) if flagged else None
    loss, grad, stats = grad_of(
        logps,
        logps,
        logps + 1,
        torch.zeros(3, dtype=F64),
        mask,
        beta=0.1,
        loss_type=loss_type,
        zero_std_flags=flags,
        num_generations=3,
    )
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert all(torch.isfinite(v) for v in stats.values())
    assert stats["num_tokens"].item() == 0
    assert stats["num_zero_std_groups"].item() == (1.0 if flagged else 0.0)


@pytest.mark.parametrize("mode", ZERO_STD_MODES)
def test_stats_over_tokens_entering_the_loss(mode):
    """ref 000.8 / ref 002 monitoring: stats are over tokens entering the loss; padding
    (ratio 1 there) never leaks into ratio_max; zero-std rows and groups are counted."""
    logps = torch.zeros(4, 3, dtype=F64)
    old = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64).unsqueeze(1).expand(4, 3)  # ratios < 1
    mask = lengths_mask([3, 2, 1, 3], 3)
    zero = torch.tensor([False, False, True, True])
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=F64)
    _, stats = grpo_loss(
        logps,
        old,
        None,
        adv,
        mask,
        zero_std=mode,
        zero_std_flags=zero,
        group_std=torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=F64),
        num_generations=2,
    )
    r = torch.exp(-old)  # [B, T]
    rows = [0, 1] if mode == "mask" else [0, 1, 2, 3]
    m = mask[rows].bool()
    assert stats["num_tokens"].item() == m.sum().item()
    assert math.isclose(stats["ratio_max"].item(), r[rows][m].max().item())
    assert math.isclose(stats["ratio_mean"].item(), r[rows][m].mean().item())
    assert stats["num_zero_std_rows"].item() == 2 and stats["num_zero_std_groups"].item() == 1
    assert stats["kl"].item() == 0.0  # no reference given


def test_bf16_inputs_compute_in_float32():
    """Loss math runs in float32 or wider even for bf16 log-probs."""
    logps, old, ref, mask = make_batch([3, 2], 3)
    loss, stats = grpo_loss(
        logps.bfloat16(), old.bfloat16(), ref.bfloat16(), torch.tensor([1.0, -1.0]), mask, beta=0.04
    )
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert stats["kl"].dtype == torch.float32


# --------------------------------------------------------------------------- bad options


def _adv_call(**kw):
    return group_advantages(torch.tensor([0.0, 1.0]), 2, **kw)


def _loss_call(**kw):
    x = torch.zeros(2, 3)
    return grpo_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), **kw)


@pytest.mark.parametrize(
    "fn,kwargs,valid",
    [
        (_adv_call, {"scale_rewards": "global"}, ["group", "batch", "none"]),
        (_adv_call, {"std": "unbiased"}, ["population", "sample"]),
        (_adv_call, {"estimator": "ppo"}, ["grpo", "rloo"]),
        (_loss_call, {"loss_type": "sum"}, LOSS_TYPES),
        (_loss_call, {"importance_sampling_level": "seq"}, LEVELS),
        (_loss_call, {"kl_estimator": "k4"}, ["k1", "k2", "k3"]),
        (_loss_call, {"zero_std": "drop"}, ZERO_STD_MODES),
        (lambda **kw: loss_normalizers(torch.ones(2, 2), **kw), {"zero_std_mode": "skip"}, ZERO_STD_MODES),
    ],
    ids=[
        "scale_rewards",
        "std",
        "estimator",
        "loss_type",
        "is_level",
        "kl_estimator",
        "zero_std",
        "normalizers-mode",
    ],
)
def test_bad_option_names_raise(fn, kwargs, valid):
    """Unknown option names fail loudly, naming the bad value and every valid one."""
    bad = next(iter(kwargs.values()))
    with pytest.raises(ValueError) as exc:
        fn(**kwargs)
    msg = str(exc.value)
    assert repr(bad) in msg
    assert all(repr(v) in msg for v in valid)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: grpo_loss(
                torch.zeros(2, 3), torch.zeros(2, 3), None, torch.zeros(2), torch.ones(2, 3), beta=0.04
            ),
            "ref_logps",
        ),
        (lambda: _loss_call(zero_std="weight"), "group_std"),
        (lambda: group_advantages(torch.zeros(6), 4), "multiple of num_generations"),
        (lambda: group_advantages(torch.zeros(3), 1, estimator="rloo"), "num_generations >= 2"),
        (
            lambda: grpo_loss(torch.zeros(2, 3), torch.zeros(2, 4), None, torch.zeros(2), torch.ones(2, 3)),
            "old_logps",
        ),
    ],
    ids=["ref-none-beta", "weight-no-std", "indivisible-batch", "rloo-g1", "shape-mismatch"],
)
def test_invalid_arguments_raise(call, match):
    """ref 004 (k3 KL needs a reference; batch a multiple of G), shape checks."""
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- signal, TIS


@pytest.mark.parametrize(
    "rewards,mask_rows,mode,beta,expected",
    [
        ([1, 0, 1, 0], [1, 1, 1, 1], "mask", 0.0, True),  # spread: signal
        ([1, 1, 0, 0], [1, 1, 1, 1], "mask", 0.04, False),  # every group zero-std: KL masked too
        ([1, 1, 0, 0], [1, 1, 1, 1], "keep", 0.0, False),  # kept rows, but no advantage and no KL
        ([1, 1, 0, 0], [1, 1, 1, 1], "keep", 0.04, True),  # TRL behaviour: the KL still pulls
        ([1, 1, 0, 0], [1, 1, 1, 1], "weight", 0.04, True),  # smooth weight: a small KL pull remains
        ([1, 0, 1, 0], [0, 0, 1, 1], "mask", 0.0, True),  # second group still has tokens
        ([1, 0, 1, 1], [1, 1, 0, 0], "mask", 0.0, True),
        ([1, 1, 1, 0], [1, 1, 0, 0], "mask", 0.0, False),  # the only spread group has no token left
    ],
    ids=[
        "spread",
        "zero-std-mask-kl",
        "zero-std-keep-no-kl",
        "zero-std-keep-kl",
        "zero-std-weight-kl",
        "partly-masked",
        "first-group-spread",
        "signal-group-masked-out",
    ],
)
def test_has_learning_signal(rewards, mask_rows, mode, beta, expected):
    """ref 002: a step whose loss has no token with a reason to move the weights has no signal."""
    adv, zero, _ = group_advantages(torch.tensor(rewards, dtype=F64), 2)
    mask = torch.tensor(mask_rows, dtype=F64).unsqueeze(1).expand(-1, 3)  # [4, 3]
    assert has_learning_signal(adv, mask, zero, zero_std_mode=mode, beta=beta) is expected


def test_truncated_importance_weights_cap_and_mask():
    trainer = torch.tensor([[-1.0, -1.0, -1.0, 5.0]], dtype=F64)
    sampler = torch.tensor([[-1.0, -1.5, -3.0, -50.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_importance_weights(trainer, sampler, mask, cap=2.0)
    expected = torch.tensor([[1.0, math.exp(0.5), 2.0, 1.0]], dtype=F64)  # capped; masked -> 1
    torch.testing.assert_close(w, expected)
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(trainer, sampler, mask, cap=0.0)


def test_importance_weights_scale_the_policy_term_not_the_kl():
    logps, old, ref, mask = make_batch([3, 2], 3)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    w = torch.full_like(logps, 0.5)
    _, g_plain, _ = grad_of(logps, old, ref, adv, mask, beta=0.0)
    _, g_weighted, _ = grad_of(logps, old, ref, adv, mask, beta=0.0, importance_weights=w)
    torch.testing.assert_close(g_weighted, 0.5 * g_plain)
    _, g_kl, _ = grad_of(logps, old, ref, torch.zeros(2, dtype=F64), mask, beta=0.1)
    _, g_kl_w, _ = grad_of(logps, old, ref, torch.zeros(2, dtype=F64), mask, beta=0.1, importance_weights=w)
    torch.testing.assert_close(g_kl_w, g_kl)  # KL gradient untouched


# --------------------------------------------------------------------------- the loss variants

_THROWAWAY = """
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin


def unclipped(ratio, adv, cfg):  # a policy term: -r A, no trust region
    return -ratio * adv  # [B, T]


def token_sum(per_token_loss, valid, counts):  # a reduction: no normaliser at all
    return per_token_loss.sum()  # []


PLUGIN = Plugin(name="throwaway", build=lambda: Variant(policy_term=unclipped, reduce=token_sum))
"""


def test_a_loss_variant_is_one_module(monkeypatch, compose, tmp_path):
    """A new built-in loss_type is one module of grpo_cli/loss/variants/ declaring PLUGIN (here
    written to a folder added to the package's path, so the package is not touched): grpo_loss
    runs its term and reduction, and config validation and the error messages take the names from
    the modules, so the new name validates with no other edit."""
    import importlib
    import sys

    from grpo_cli.config import validate
    from grpo_cli.loss import variants

    name = "throwaway"
    logps, old, ref, mask = make_batch([3, 2, 0], 3)
    old[0, 0] = logps[0, 0] - 1.0  # ratio e: far outside the clip range, the surrogate's gradient is 0
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    assert any(f"loss.loss_type='{name}'" in p for p in validate(compose([f"loss.loss_type={name}"])))
    with pytest.raises(ValueError, match=name):
        grpo_loss(logps, old, ref, adv, mask, loss_type=name)

    (tmp_path / f"{name}.py").write_text(_THROWAWAY)
    monkeypatch.setattr(variants, "__path__", [*variants.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    try:
        assert name in loss_module.LOSSES and list(loss_module.LOSSES) == sorted(loss_module.LOSSES)
        assert validate(compose([f"loss.loss_type={name}"])) == []
        assert f", {name};" in str(pytest.raises(ValueError, loss_module.variant, "nosuch").value)
        loss, grad, _ = grad_of(logps, old, ref, adv, mask, loss_type=name, beta=0.1)
    finally:
        sys.modules.pop(f"{variants.__name__}.{name}", None)
        vars(variants).pop(name, None)
        loss_module.variant.cache_clear()
    ratio = torch.exp(logps - old)  # [B, T]
    kl = per_token_kl(logps, ref, mask)  # [B, T], k3
    torch.testing.assert_close(loss, ((-ratio * adv[:, None] + 0.1 * kl) * mask).sum())
    # d(-r A)/dlogp = -r A; d(k3)/dlogp = 1 - exp(ref - logp)
    torch.testing.assert_close(grad, (-ratio * adv[:, None] + 0.1 * (1 - torch.exp(ref - logps))) * mask)
    _, clipped_grad, _ = grad_of(logps, old, ref, adv, mask, loss_type="bnpo")
    assert clipped_grad[0, 0] == 0 and grad[0, 0] != 0  # the variant's term, not the clipped one


def test_each_builtin_variant_is_a_plugin_named_by_its_module():
    """The built-ins are the modules of grpo_cli/loss/variants/, each a Plugin named by its file
    whose build gives the Variant that loss.LOSSES and loss.variant return."""
    from grpo_cli import plugins

    assert list(loss_module.LOSSES) == sorted(LOSS_TYPES)
    for name in LOSS_TYPES:
        declared = plugins.load(loss_module.VARIANTS, name, "loss.loss_type")
        assert declared.name == name and isinstance(declared.build(), loss_module.Variant)
        assert loss_module.LOSSES[name] is loss_module.variant(name)
    assert "ppo" not in loss_module.LOSSES


# --------------------------------------------------------------------------- CISPO and SAPO


def _off_policy_batch():
    """Rows of different lengths, ratios well off 1 both ways, advantages of both signs."""
    g = torch.Generator().manual_seed(3)
    logps = -torch.rand(4, 5, generator=g, dtype=F64) * 2.0 - 0.1  # [B, T]
    old = logps + torch.tensor([-1.2, 0.8, -0.4, 2.5], dtype=F64).unsqueeze(1) * torch.rand(
        4, 5, generator=g, dtype=F64
    )  # [B, T]: ratios from ~0.1 to ~10
    mask = lengths_mask([5, 3, 4, 2], 5)
    adv = torch.tensor([1.5, -0.7, 0.9, -1.2], dtype=F64)
    return logps, old, mask, adv


@pytest.mark.parametrize("weight_max", [5.0, 1.3])
def test_cispo_is_trls_formula(weight_max):
    """CISPO against TRL's formula written here: per token -sg(min(r, eps_max)) * A * logp, summed
    over the valid tokens and divided by their count (TRL's normaliser for cispo). The gradient is
    TRL's exactly; the value differs from TRL's by the constant -w A old_logp (the term is
    written on log r = logp - old_logp), so it is compared with that constant added back."""
    logps, old, mask, adv = _off_policy_batch()
    loss, grad, stats = grad_of(
        logps, old, None, adv, mask, loss_type="cispo", options={"weight_max": weight_max}
    )
    leaf = logps.clone().requires_grad_(True)
    r = torch.exp(leaf - old)
    w = torch.clamp(r, max=weight_max).detach()
    trl = (-w * adv.unsqueeze(1) * leaf * mask).sum() / mask.sum()
    trl.backward()
    constant = (-w * adv.unsqueeze(1) * old * mask).sum() / mask.sum()
    assert torch.allclose(loss, trl.detach() - constant, atol=1e-12)
    assert torch.allclose(grad, leaf.grad, atol=1e-12)
    # Every valid token keeps a gradient (no hard clip), the padding none.
    assert bool((grad[mask.bool()] != 0).all()) and bool((grad[~mask.bool()] == 0).all())
    capped = ((r.detach() > weight_max) & (adv.unsqueeze(1) > 0) & mask.bool()).sum() / mask.sum()
    assert math.isclose(stats["cispo_clip_ratio"].item(), capped.item())
    assert (capped > 0) == (weight_max == 1.3)  # the low cap bites, TRL's 5.0 does not here


@pytest.mark.parametrize("temps", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_is_trls_formula(temps):
    """SAPO against TRL's formula written here: per token -(4/tau) sigmoid(tau (r - 1)) A with tau
    by the advantage's sign, then grpo's per-sequence mean; value and gradient."""
    logps, old, mask, adv = _off_policy_batch()
    pos, neg = temps
    options = {"temperature_pos": pos, "temperature_neg": neg}
    loss, grad, stats = grad_of(logps, old, None, adv, mask, loss_type="sapo", options=options)
    leaf = logps.clone().requires_grad_(True)
    r = torch.exp(leaf - old)
    a = adv.unsqueeze(1)
    tau = torch.where(a > 0, torch.tensor(pos, dtype=F64), torch.tensor(neg, dtype=F64))
    per_token = -(torch.sigmoid(tau * (r - 1)) * 4 / tau) * a
    trl = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    trl.backward()
    assert torch.allclose(loss, trl.detach(), atol=1e-12)
    assert torch.allclose(grad, leaf.grad, atol=1e-12)
    s = torch.sigmoid(tau * (r.detach() - 1))
    gate = ((4 * s * (1 - s)) * mask).sum() / mask.sum()
    assert math.isclose(stats["sapo/gate_mean"].item(), gate.item(), rel_tol=1e-12)
    assert 0 < gate.item() < 1  # off policy: the gate has closed some


def test_sapo_gate_is_one_on_policy_and_softer_than_the_clip():
    """One token, A = 1: on policy SAPO's gradient is grpo's (-1); at r = 1.5, outside grpo's
    trust region where the clip gives exactly 0, SAPO's is small but not zero."""
    mask = torch.ones(1, 1, dtype=F64)
    a = torch.ones(1, dtype=F64)
    for r, grpo_zero in [(1.0, False), (1.5, True)]:
        logps = torch.zeros(1, 1, dtype=F64)
        old = logps - math.log(r)
        _, g_grpo, _ = grad_of(logps, old, None, a, mask, loss_type="grpo")
        _, g_sapo, _ = grad_of(logps, old, None, a, mask, loss_type="sapo")
        assert (g_grpo.item() == 0) == grpo_zero
        if r == 1.0:
            assert math.isclose(g_sapo.item(), -1.0)
        else:
            assert -1.0 < g_sapo.item() * (1 / r) < 0  # d/dlogp = r d/dr: weight below 1, not 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss=cispo", "loss.options.weight_max=0"], "loss.options.weight_max=0 must be a number > 0"),
        (["loss=cispo", "loss.importance_sampling_level=sequence"], "choose loss=gspo"),
        (["loss=sapo", "loss.options.temperature_neg=-1"], "loss.options.temperature_neg=-1"),
        (["loss=sapo", "+loss.options.weight_max=2"], "which sapo does not read"),
        (["loss=grpo", "+loss.options.weight_max=2"], "grpo takes no options"),
    ],
)
def test_the_variants_options_are_checked_before_the_run(compose, overrides, message):
    from grpo_cli.config import validate

    problems = validate(compose(overrides))
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_the_presets_compose_and_validate(compose, name):
    from grpo_cli.config import validate

    cfg = compose([f"loss={name}"])
    assert cfg.loss.loss_type == name and validate(cfg) == []


# --------------------------------------------------------------------------- GDPO


def _gdpo_by_hand(values, weights, G, eps=1e-4, std="population"):
    """GDPO written out loop by loop: per group, per reward, (v - mean) / (std + eps) over the
    values present (0 where the reward is constant in the group or absent), weighted, summed."""
    out = []
    for g in range(0, len(values), G):
        rows = values[g : g + G]
        for i in range(G):
            total = 0.0
            for k, w in enumerate(weights):
                col = [r[k] for r in rows if not math.isnan(r[k])]
                if math.isnan(rows[i][k]) or not col:
                    continue
                m = sum(col) / len(col)
                n = len(col) - 1 if std == "sample" and len(col) > 1 else len(col)
                s = math.sqrt(sum((c - m) ** 2 for c in col) / n)
                if s < 1e-6:
                    continue
                total += w * (rows[i][k] - m) / (s + eps)
            out.append(total)
    return out


@pytest.mark.parametrize("std", ["population", "sample"])
def test_normalize_then_sum_is_gdpo(std):
    """Per reward within its group, then the weighted sum (TRL's normalize_then_sum), against the
    loops above: a reward constant in a group adds 0, an absent value (None: NaN) adds nothing."""
    nan = float("nan")
    values = [
        [1.0, 0.2],
        [0.0, 0.2],
        [1.0, 0.0],
        [0.0, nan],  # group 0: both rewards vary (one value absent)
        [1.0, 0.5],
        [1.0, 0.1],
        [1.0, 0.3],
        [1.0, 0.9],  # group 1: correctness constant, shaping varies
    ]
    weights = [1.0, 0.25]
    got = loss_module.normalize_then_sum(
        torch.tensor(values, dtype=F64), torch.tensor(weights, dtype=F64), 4, cfg=LossConfig(std=std)
    )
    assert torch.allclose(
        got, torch.tensor(_gdpo_by_hand(values, weights, 4, std=std), dtype=F64), atol=1e-12
    )


def test_gdpo_keeps_a_large_shaping_reward_from_drowning_correctness():
    """A shaping reward 100x the correctness reward's scale: summed first, the advantages follow
    the shaping reward (the correct row is not on top); normalised first, correctness counts as
    much as shaping, and the zero-std rule holds where both are constant."""
    values = torch.tensor(
        [[1.0, 10.0], [0.0, 30.0], [0.0, 20.0], [0.0, 0.0], [1.0, 5.0], [1.0, 5.0], [1.0, 5.0], [1.0, 5.0]],
        dtype=F64,
    )
    weights = torch.tensor([1.0, 1.0], dtype=F64)
    summed, _, _ = group_advantages((values * weights).sum(-1), 4)
    combined = loss_module.normalize_then_sum(values, weights, 4, cfg=LossConfig())
    gdpo, zero, _ = group_advantages(combined, 4)
    assert summed[:4].argmax().item() == 1  # the shaping reward decides
    assert gdpo[0] > gdpo[2] and gdpo[0] > gdpo[3]  # the correct row now beats the ones worth less shaping
    assert zero.tolist() == [False] * 4 + [True] * 4 and torch.equal(gdpo[4:], torch.zeros(4, dtype=F64))


# --------------------------------------------------------------------------- entropy terms


@pytest.mark.parametrize("mode", ZERO_STD_MODES)
def test_entropy_bonus_is_minus_coef_times_the_mean_entropy(mode):
    """loss(coef) - loss(0) = -coef * sum(H over the tokens in the loss, zero-std rows left out) /
    the step's tokens; its gradient wrt H is -coef / num_tokens there and exactly 0 on padding and
    on the zero-std group's rows, whatever the zero_std mode (ref 002)."""
    logps, old, ref, mask, adv, zero, gstd = zero_std_setup()
    entropy = torch.rand(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(4)) * 3
    n_seq, n_tok = loss_normalizers(mask, zero, zero_std_mode=mode)
    kw = dict(
        beta=0.04, zero_std=mode, zero_std_flags=zero, group_std=gstd, num_sequences=n_seq, num_tokens=n_tok
    )
    base, _ = grpo_loss(logps, old, ref, adv, mask, **kw)
    leaf = entropy.clone().requires_grad_(True)
    with_bonus, _ = grpo_loss(logps, old, ref, adv, mask, entropy=leaf, entropy_coef=0.05, **kw)
    with_bonus.backward()
    keep = mask.bool() & ~zero.unsqueeze(1)
    assert torch.allclose(with_bonus - base, -0.05 * entropy[keep].sum() / n_tok, atol=1e-12)
    assert torch.allclose(leaf.grad[keep], torch.full_like(leaf.grad[keep], -0.05 / n_tok))
    assert torch.equal(leaf.grad[~keep], torch.zeros_like(leaf.grad[~keep]))


def test_entropy_bonus_accumulates_to_the_steps_mean():
    """Micro-batches of 2 rows sum to the one-call loss and entropy gradient (step-wide counts)."""
    logps, old, ref, mask = make_batch([5, 2, 4, 1, 3, 5], 5, seed=2)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=F64)
    entropy = torch.rand(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(6))
    n_seq, n_tok = loss_normalizers(mask)
    kw = dict(entropy_coef=0.1, loss_type="dapo", num_sequences=n_seq, num_tokens=n_tok)
    full_leaf = entropy.clone().requires_grad_(True)
    full, _ = grpo_loss(logps, old, None, adv, mask, entropy=full_leaf, **kw)
    full.backward()
    leaf = entropy.clone().requires_grad_(True)
    total = sum(
        grpo_loss(
            logps[s : s + 2],
            old[s : s + 2],
            None,
            adv[s : s + 2],
            mask[s : s + 2],
            entropy=leaf[s : s + 2],
            **kw,
        )[0]
        for s in range(0, 6, 2)
    )
    total.backward()
    assert torch.allclose(total, full) and torch.allclose(leaf.grad, full_leaf.grad)


@pytest.mark.parametrize(
    "coef, entropy, expected",
    [
        (0.0, 0.1, 0.005),  # at or below the target: up by delta
        (0.2, 0.2, 0.205),  # (the target itself counts as below, as in TRL)
        (0.2, 0.3, 0.195),  # above: down by delta
        (0.001, 5.0, 0.0),  # held at entropy_coef_min
        (0.498, 0.0, 0.5),  # held at entropy_coef_max
    ],
)
def test_adaptive_entropy_coefficient_moves_by_delta_within_its_bounds(coef, entropy, expected):
    """TRL's controller (use_adaptive_entropy): coef + delta when the step's entropy is at or below
    the target, coef - delta above it, clamped to [entropy_coef_min, entropy_coef_max]."""
    from grpo_cli.config.schema import LossConfig
    from grpo_cli.loss import adapt_entropy_coef

    cfg = LossConfig(
        use_adaptive_entropy=True, entropy_target=0.2, entropy_coef_max=0.5, entropy_coef_delta=0.005
    )
    assert adapt_entropy_coef(coef, entropy, cfg) == pytest.approx(expected, abs=1e-12)


def test_adaptive_entropy_applies_its_coefficient_only_below_the_target():
    """A step's bonus: the controller's coefficient where the previous step's entropy was at or
    below the target, 0 above it and before any step (inf); without the controller, entropy_coef."""
    from grpo_cli.config.schema import LossConfig
    from grpo_cli.loss import applied_entropy_coef

    adaptive = LossConfig(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.2)
    assert applied_entropy_coef(0.03, math.inf, adaptive) == 0.0
    assert applied_entropy_coef(0.03, 0.2, adaptive) == 0.03
    assert applied_entropy_coef(0.03, 0.21, adaptive) == 0.0
    static = LossConfig(entropy_coef=0.01)
    assert applied_entropy_coef(0.03, math.inf, static) == 0.01


@pytest.mark.parametrize("quantile", [0.2, 0.5])
def test_top_entropy_quantile_trains_the_high_entropy_tokens_only(quantile):
    """TRL's rule written here: the threshold is the (1 - q) quantile of the valid tokens'
    entropies; the policy term's gradient is the unmasked one on tokens at or above it and 0 on
    the others (the normaliser unchanged)."""
    logps, old, ref, mask = make_batch([5, 3, 4, 5], 5, seed=8)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    entropy = torch.rand(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    _, g_all, _ = grad_of(logps, old, None, adv, mask)
    _, g_top, _ = grad_of(logps, old, None, adv, mask, entropy=entropy, top_entropy_quantile=quantile)
    threshold = torch.quantile(entropy[mask.bool()], 1 - quantile)
    high = (entropy >= threshold) & mask.bool()
    assert 0 < high.sum() < mask.sum()
    assert torch.allclose(g_top[high], g_all[high]) and torch.equal(
        g_top[~high], torch.zeros_like(g_top[~high])
    )


def test_entropy_terms_without_the_entropy_raise():
    logps, old, _, mask = make_batch([3, 2], 3)
    with pytest.raises(ValueError, match="needs the entropy"):
        grpo_loss(logps, old, None, torch.ones(2, dtype=F64), mask, entropy_coef=0.1)


# --------------------------------------------------------------------------- sequence masks


def test_sequence_mask_weights_are_trls_sequence_mask():
    """TRL's sequence_mask written here: rho = exp(sum over the row's tokens of trainer - sampler),
    the row's weight inside [floor, cap], 0 outside; padding adds nothing to the sum."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0], [-0.2, -0.3, -0.4]], dtype=F64)
    sampler = torch.tensor([[-1.5, -2.5, -0.6], [-0.1, -0.2, 0.0], [-0.25, -0.35, -0.45]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=F64)
    w = loss_module.sequence_mask_weights(trainer, sampler, mask, cap=2.0, floor=0.5)
    rho = torch.exp(((trainer - sampler) * mask).sum(-1))  # [3]: e^1.1, e^-1.7, e^0.15
    expected = torch.where((rho > 2.0) | (rho < 0.5), torch.zeros_like(rho), rho)
    assert torch.allclose(w, expected.unsqueeze(1).expand_as(w))
    assert w[0].eq(0).all() and w[1].eq(0).all() and w[2].gt(1).all()  # above the cap, below the floor, kept


def test_off_policy_mask_drops_negative_far_off_policy_sequences():
    """DeepSeek-V3.2's mask, as TRL computes it: only a sequence with a negative advantage and a
    mean (sampler - policy) log-prob gap above the threshold leaves the policy term."""
    logps = torch.full((4, 3), -1.0, dtype=F64)
    sampler = torch.tensor(
        [[-0.1] * 3, [-0.1] * 3, [-0.9] * 3, [-0.9] * 3], dtype=F64
    )  # gaps 0.9, 0.9, 0.1, 0.1
    mask = torch.ones(4, 3, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    _, g_plain, _ = grad_of(logps, logps, None, adv, mask)
    _, g_masked, stats = grad_of(
        logps, logps, None, adv, mask, sampler_logps=sampler, off_policy_mask_threshold=0.5
    )
    kept = torch.tensor([True, False, True, True])
    assert torch.equal(g_masked[~kept], torch.zeros_like(g_masked[~kept]))
    assert torch.allclose(g_masked[kept], g_plain[kept])
    assert math.isclose(stats["off_policy_mask/masked"].item(), 0.25)


# --------------------------------------------------------------------------- the teacher


@pytest.mark.parametrize("mode", ZERO_STD_MODES)
def test_teacher_term_is_the_reverse_kl_through_the_policy_gradient(mode):
    """The term written here: coef * sum(sg(logp - teacher_logp) * r) / all trained tokens; at r = 1
    its gradient per token is coef * (logp - teacher_logp) / all_tokens, on every trained token,
    the zero-std group's included (the teacher's signal does not depend on the rewards); the
    policy term still gives that group nothing."""
    logps, old, ref, mask, adv, zero, gstd = zero_std_setup()
    teacher = logps + 0.4 * torch.randn(logps.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    n_seq, n_tok = loss_normalizers(mask, zero, zero_std_mode=mode)
    all_tok = int(mask.sum())
    kw = dict(zero_std=mode, zero_std_flags=zero, group_std=gstd, num_sequences=n_seq, num_tokens=n_tok)
    on = logps.detach().clone()
    base, g_base, _ = grad_of(logps, on, None, adv, mask, **kw)
    counts_kw = dict(kw)
    loss, grad, stats = grad_of(
        logps, on, None, adv, mask, teacher_logps=teacher, teacher_kl=0.5, all_tokens=all_tok, **counts_kw
    )
    k1 = (logps - teacher) * mask
    assert torch.allclose(loss - base, 0.5 * k1.sum() / all_tok, atol=1e-12)
    assert torch.allclose(grad - g_base, 0.5 * k1 / all_tok, atol=1e-12)
    assert bool((grad[2:][mask[2:].bool()] != 0).all())  # the zero-std group: the teacher's gradient
    assert math.isclose(stats["teacher/kl"].item(), (k1.sum() / mask.sum()).item())
    assert math.isclose(stats["teacher/logp"].item(), ((teacher * mask).sum() / mask.sum()).item())


def test_pure_distillation_trains_every_row_with_no_reward_signal():
    """No reward signal at all (every group zero-std, advantages 0): the policy term is 0 and the
    teacher alone gives the gradient, on every row; the step still has a signal to step on."""
    logps, old, _, mask = make_batch([4, 3, 4, 2], 4, seed=3)
    teacher = logps - 0.3
    zero = torch.ones(4, dtype=torch.bool)
    adv = torch.zeros(4, dtype=F64)
    _, grad, _ = grad_of(
        logps,
        logps.detach().clone(),
        None,
        adv,
        mask,
        zero_std_flags=zero,
        teacher_logps=teacher,
        teacher_kl=1.0,
    )
    assert torch.allclose(grad, 0.3 * mask / mask.sum())
