"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

OPTIMIZERS = ("adamw",)
LR_SCHEDULERS = ("constant", "linear", "cosine")


def build_optimizer(
    params,
    *,
    learning_rate: float,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_epsilon: float,
    lr_scheduler: str,
    warmup_steps: int,
    total_updates: int,
):
    """AdamW over `params` (the trainable parameters) and its schedule (transformers' schedulers,
    stepped once per applied update)."""
    import torch
    from transformers import get_scheduler

    params = [p for p in params if p.requires_grad]
    # The fused kernel (one pass over each tensor) is the same update as the default multi-tensor
    # one, about 5x faster on a CPU (0.13 s vs 0.68 s a step for 135M parameters here).
    fused = all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params
    )
    optimizer = torch.optim.AdamW(
        params,
        lr=learning_rate,
        betas=(adam_beta1, adam_beta2),
        eps=adam_epsilon,
        weight_decay=weight_decay,
        fused=fused or None,
    )
    scheduler = get_scheduler(
        lr_scheduler, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_updates
    )
    return optimizer, scheduler
