"""Step-0 self-check (ref 000.8): on every micro-batch of the first step, before any update, the
trainer's log-probs must equal the sampler's within the precision's rounding (the trainer scores
the distribution the sampler drew from), there must be valid tokens, advantages of both
signs (or a report that every group is zero-std), and a finite loss and gradient.

On a mismatch it probes the usual causes and names the likely one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.errors import TrainingDiverged
from grpo_cli.logprobs import model_logits, selective_logprobs

# The tolerances are the sampler's own (samplers.Sampler.tolerance, per precision): what its numerics
# explain of |trainer - sampler| log-prob; the built-in sampler's are in samplers/builtin.py.


class SelfCheckError(TrainingDiverged):
    """The step-0 self-check failed: exit 3 with the diagnosis, before any update."""


@dataclass
class LogprobCheck:
    sum_abs_diff: float
    max_abs_diff: float
    valid_tokens: int
    tolerance: tuple[float, float]  # (mean, max)

    @property
    def mean_abs_diff(self) -> float:
        return self.sum_abs_diff / max(self.valid_tokens, 1)

    @property
    def ok(self) -> bool:
        mean_tol, max_tol = self.tolerance
        return self.valid_tokens > 0 and self.mean_abs_diff <= mean_tol and self.max_abs_diff <= max_tol

    def merge(self, other: LogprobCheck | None) -> LogprobCheck:
        """This check and `other` (of other micro-batches of the same step) as one."""
        if other is None:
            return self
        return LogprobCheck(
            self.sum_abs_diff + other.sum_abs_diff,
            max(self.max_abs_diff, other.max_abs_diff),
            self.valid_tokens + other.valid_tokens,
            self.tolerance,
        )

    def describe(self) -> str:
        mean_tol, max_tol = self.tolerance
        return (
            f"|trainer - sampler| log-prob mean {self.mean_abs_diff:.2e} (tolerance {mean_tol:g}), "
            f"max {self.max_abs_diff:.2e} (tolerance {max_tol:g}) over {self.valid_tokens} tokens"
        )


def compare_logprobs(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    tolerance: tuple[float, float],
) -> LogprobCheck:
    """|trainer - sampler| log-prob over the trained tokens (mask [B, C]: Rollout.trained_mask) of
    a micro-batch, against the sampler's declared (mean, max) tolerance."""
    valid = mask.bool()  # [B, C]
    diff = (trainer_logps.float() - sampler_logps.float()).abs()[valid]  # [valid tokens]
    return LogprobCheck(
        float(diff.sum()), float(diff.max()) if diff.numel() else 0.0, int(valid.sum()), tolerance
    )


@torch.no_grad()
def diagnose(model, rollout, temperature: float) -> str:
    """Recompute the log-probs of a rollout's (rollout.Rollout) completions the usual wrong ways;
    the one that matches its sampler_logps (over its trained_mask) names the bug."""
    r = rollout
    prompt_ids, prompt_mask, completion_ids, attention_mask = (
        r.prompt_ids,
        r.prompt_mask,
        r.completion_ids,
        r.attention_mask,
    )
    trained_mask, sampler_logps = r.trained_mask, r.sampler_logps
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, attention_mask], 1).long()
    C = completion_ids.shape[1]
    valid = trained_mask.bool()

    def err(logps):
        return float((logps.float() - sampler_logps.float()).abs()[valid].max())

    probes = {}
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model_logits(model, input_ids=input_ids, attention_mask=attn, position_ids=pos).float()
    probes["temperature (trainer and sampler use different temperatures)"] = err(
        selective_logprobs(logits[:, -C - 1 : -1], completion_ids)
    )
    probes["shift (logits at t must score token t+1)"] = err(
        selective_logprobs(logits[:, -C:] / temperature, completion_ids)
    )
    plain = model_logits(model, input_ids=input_ids).float()
    probes["padding (attention mask / position ids ignored)"] = err(
        selective_logprobs(plain[:, -C - 1 : -1] / temperature, completion_ids)
    )
    best = min(probes, key=probes.get)
    lines = [f"  {name}: max diff {value:.3g}" for name, value in probes.items()]
    return (
        f"likely cause: {best}\nprobes (a small diff means that mistake reproduces the "
        "sampler's numbers):\n" + "\n".join(lines)
    )


@dataclass(frozen=True)
class FirstStep:
    """The step-0 self-check (ref 000.8) of a run's first step: what it needs beyond each
    micro-batch's log-prob comparison (the policy, to diagnose a mismatch, the precision's name
    and the sampling temperature)."""

    policy: object
    precision: str
    temperature: float

    def micro_batch(self, check: LogprobCheck, mb, worst: LogprobCheck | None) -> LogprobCheck:
        """One micro-batch `mb` (a rollout.Rollout) of the first step, before any update: `check`
        (compare_logprobs of the trainer's and the sampler's log-probs over its trained tokens)
        must be within the sampler's tolerance (same tempered distribution, same shift and
        padding). Raises SelfCheckError with a diagnosis; returns `check` merged with `worst` (the
        earlier micro-batches')."""
        if not check.ok:
            with torch.no_grad():
                why = diagnose(self.policy, mb, self.temperature)
            raise SelfCheckError(
                f"step-0 self-check failed ({self.precision}): {check.describe()}, so the trainer does not "
                f"score the distribution the sampler drew from.\n{why}"
            )
        return check.merge(worst)


def report(check: LogprobCheck, advantages: torch.Tensor, zero_std: torch.Tensor, micro_batches: int) -> str:
    """The self-check's one line: how close the log-probs were, and the advantages' signs."""
    signs = (
        "both signs"
        if (advantages > 0).any() and (advantages < 0).any()
        else (
            "every group zero-std (no learning signal in this batch)"
            if bool(zero_std.all())
            else "one sign only"
        )
    )
    return (
        f"self-check ok: {check.describe()} of the first step "
        f"({micro_batches} micro-batch{'es' if micro_batches > 1 else ''}); advantages: {signs}"
    )
