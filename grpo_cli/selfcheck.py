"""Step-0 self-check (ref 000.8): on the first rollout, before any update, the trainer's
log-probs must equal the sampler's (ratio == 1), there must be valid tokens, advantages of both
signs (or a report that every group is zero-std), and a finite loss and gradient.

On a mismatch it probes the usual causes and names the likely one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.errors import TrainingDiverged
from grpo_cli.logprobs import selective_logprobs

# Max |trainer - sampler| log-prob over valid tokens. fp32 differs only by kernel order
# (KV-cache decode vs one full forward); bf16/fp16 autocast rounds activations.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.25, "fp16": 0.25}


class SelfCheckError(TrainingDiverged):
    """The step-0 self-check failed: exit 3 with the diagnosis, before any update."""


@dataclass
class LogprobCheck:
    max_abs_diff: float
    ratio_max_dev: float
    valid_tokens: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.valid_tokens > 0 and self.max_abs_diff <= self.tolerance


def compare_logprobs(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                     precision: str) -> LogprobCheck:
    valid = mask.bool()  # [B, C]
    diff = (trainer_logps.float() - sampler_logps.float()).abs()[valid]
    max_diff = float(diff.max()) if diff.numel() else 0.0
    return LogprobCheck(max_diff, float(torch.expm1(diff.clamp(max=20)).max()) if diff.numel() else 0.0,
                        int(valid.sum()), TOLERANCE[precision])


@torch.no_grad()
def diagnose(model, prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logps,
             temperature: float) -> str:
    """Recompute the log-probs the usual wrong ways; the one that matches the sampler names the bug."""
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1).long()
    C = completion_ids.shape[1]
    valid = completion_mask.bool()

    def err(logps):
        return float((logps.float() - sampler_logps.float()).abs()[valid].max())

    probes = {}
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=pos).logits.float()
    probes["temperature (trainer and sampler use different temperatures)"] = err(
        selective_logprobs(logits[:, -C - 1:-1], completion_ids))
    probes["shift (logits at t must score token t+1)"] = err(
        selective_logprobs(logits[:, -C:] / temperature, completion_ids))
    plain = model(input_ids=input_ids).logits.float()
    probes["padding (attention mask / position ids ignored)"] = err(
        selective_logprobs(plain[:, -C - 1:-1] / temperature, completion_ids))
    best = min(probes, key=probes.get)
    lines = [f"  {name}: max diff {value:.3g}" for name, value in probes.items()]
    return (f"likely cause: {best}\nprobes (a small diff means that mistake reproduces the "
            "sampler's numbers):\n" + "\n".join(lines))
