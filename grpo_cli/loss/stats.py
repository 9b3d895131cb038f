"""The detached stats of one ``grpo_loss`` call: KL, clip fractions, ratio mean and max, the
tokens entering the loss and the zero-std rows and groups."""

from __future__ import annotations

import torch
from torch import Tensor


def loss_stats(
    ratio: Tensor,
    adv: Tensor,
    kl: Tensor,
    valid: Tensor,
    zero_std_flags: Tensor | None,
    clip: tuple[float, float],
    num_generations: int | None,
) -> dict[str, Tensor]:
    """grpo_loss's detached stats: ratio [B, T], adv [B, 1], kl [B, T], valid [B, T] bool, the
    clip range ``(eps_low, eps_high)``; means over the valid tokens (0 when there are none), in
    the compute dtype, the ratio's."""
    eps_low, eps_high = clip
    cdtype = ratio.dtype  # importance_ratio computes in the compute dtype of logps
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
