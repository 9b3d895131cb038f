"""Live health warnings: the failure modes users of every GRPO trainer meet (ref 004's "watch"
list and troubleshooting table), spotted in each step's metrics row while the run goes on.

Each kind is said once, when it first holds, with its fix; at the end of the run one summary
says which held and over which steps. A kind that needs to persist (a noisy single step is not
a trend) must hold for `steps` steps in a row. The thresholds, and why:

- no learning signal: frac_reward_zero_std >= 0.8 for 5 steps (four groups in five carry no
  gradient; ref 002);
- truncation: completions/clipped_ratio > 0.5 for 3 steps (a cut-off answer usually scores 0;
  an instruct model's first steps often ramble past a short limit until it learns the format,
  as the default recipe does for two steps: not yet a trend);
- flat rewards: reward_std < 0.1 for 5 steps (ref 004: it should stay above ~0.1);
- entropy collapse: entropy under 0.1 nats per token and under 20% of the run's first step,
  for 3 steps. At 0.1 a sampled token is the likeliest one ~98% of the time, so most of a
  group's 10-token completions coincide and the group's signal goes. A fall alone is no
  collapse: the default recipe's entropy drops from ~1.5 to ~0.3 as it learns the answer format
  (short answers are low-entropy text) while its groups still differ and accuracy still rises;
- KL: kl > 0.5 nats per token with loss.beta > 0 (ref 004: kl starts near 0 and grows slowly; a
  jump means the policy left the reference; k3 at 0.5 is a far-off policy);
- clipping: the last update's clip ratio (clip_ratio/region_mean_last) outside 5%-30% for 5
  steps when trainer.num_iterations > 1 (ref 004: healthy ~5%-30%; the first update of a rollout
  has ratio 1 and never clips, so the mean over updates would shift the band);
- sampler/trainer mismatch: sampler/logp_diff_mean > 0.1 (bf16 decode measures ~0.03 here;
  fp32 ~1e-6): the sampled tokens are scored differently from how they were drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

Row = dict[str, Any]


@dataclass
class Rule:
    name: str  # a short title, for the summary
    steps: int  # how many steps in a row it must hold
    holds: Callable[[Row, Row], bool]  # (this row, the run's first row) -> whether it holds
    message: Callable[[Row], str]  # the warning, with the fix
    streak: int = 0
    said: bool = False
    held: list[int] = field(default_factory=list)  # the steps it held on (after its streak began)


def _outside(value: float, low: float, high: float) -> bool:
    """Whether a value lies outside [low, high]; a missing (NaN) one does not."""
    return value < low or value > high


def _value(row: Row, key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def _entropy(row: Row) -> float:
    """The policy's entropy per token: measured over the rows trained on, or, on a step that trained
    on none (every group zero-std and skipped, as in a collapse), the sampled tokens' mean negative
    log-prob (its Monte Carlo estimate, over every row)."""
    value = _value(row, "entropy")
    return value if math.isfinite(value) else _value(row, "sampler/neg_logp_mean")


# sampler/trainer mismatch: a gap no sampler's rounding explains (bf16 decode measures ~0.03 here),
# or the sampler's own declared tolerance where that is looser (samplers.Sampler.tolerance).
MISMATCH_NATS = 0.1


def rules(
    num_iterations: int, beta: float, dynamic_sampling: bool = False, mismatch_tolerance: float = 0.0
) -> list[Rule]:
    """The checks that apply to this run's settings."""
    mismatch = max(MISMATCH_NATS, mismatch_tolerance)
    more = (
        "trainer.dynamic_sampling is on and trains on the groups with signal, but most rollouts are wasted"
        if dynamic_sampling
        else "set trainer.dynamic_sampling=true to train only on groups with signal, or "
        "sampler.max_generations=32 to sample more completions of a prompt until its group holds a pass "
        "and a fail"
    )
    found = [
        Rule(
            "no learning signal",
            5,
            lambda r, first: _value(r, "frac_reward_zero_std") >= 0.8,
            lambda r: (
                f"{_value(r, 'frac_reward_zero_std'):.0%} of the sampled groups were zero-std (every "
                "completion of a prompt scored alike) for 5 steps in a row: they carry no learning signal. "
                "Raise sampler.temperature, use data the model sometimes solves (the pass-rate histogram "
                f"pass_rate_hist in metrics.jsonl shows where it stands; {more}), and check the reward with "
                "grpo-reward-test."
            ),
        ),
        Rule(
            "truncated completions",
            3,
            lambda r, first: _value(r, "completions/clipped_ratio") > 0.5,
            lambda r: (
                f"{_value(r, 'completions/clipped_ratio'):.0%} of the completions hit "
                "sampler.max_new_tokens without an end of sequence, 3 steps in a row: a cut-off answer "
                "usually scores 0. Raise sampler.max_new_tokens, or set "
                "loss.mask_truncated_completions=true to leave them out of the loss."
            ),
        ),
        Rule(
            "flat rewards",
            5,
            lambda r, first: _value(r, "reward_std") < 0.1,
            lambda r: (
                f"reward_std={_value(r, 'reward_std'):.3g}: the rewards within a group barely differ (below 0.1 "
                "for 5 steps in a row), so the advantages are mostly noise or zero. Check that the reward "
                "separates good from bad completions (grpo-reward-test), give it more levels (e.g. partial "
                "credit or a format reward), or raise sampler.temperature."
            ),
        ),
        Rule(
            "entropy collapse",
            3,
            lambda r, first: _entropy(r) < min(0.1, 0.2 * _entropy(first)),
            lambda r: (
                f"the policy's entropy fell to {_entropy(r):.3g} nats per token (under 0.1, and under "
                "20% of its first step's) 3 steps in a row: the samples stop differing and the learning signal goes "
                "with them. Lower optimizer.learning_rate, raise sampler.temperature, or anchor the policy "
                "with loss.beta=0.04; a checkpoint from before the collapse may be the one to keep."
            ),
        ),
        Rule(
            "sampler/trainer mismatch",
            1,
            lambda r, first: _value(r, "sampler/logp_diff_mean") > mismatch,
            lambda r: (
                f"sampler/logp_diff_mean={_value(r, 'sampler/logp_diff_mean'):.3g}: the trainer scores the "
                f"sampled tokens differently from how the sampler drew them (over {mismatch:g} nats per token; "
                "bf16 measures ~0.03). Use trainer.precision=fp32, or correct for it with "
                "loss.sampler_correction=tis."
            ),
        ),
    ]
    if beta > 0:
        found.append(
            Rule(
                "KL",
                1,
                lambda r, first: _value(r, "kl") > 0.5,
                lambda r: (
                    f"kl={_value(r, 'kl'):.3g} nats per token (over 0.5): the policy moved far from the "
                    f"reference model (loss.beta={beta:g}). Lower optimizer.learning_rate or raise loss.beta, "
                    "and read the completions (completions.jsonl) for reward hacking."
                ),
            )
        )
    if num_iterations > 1:
        found.append(
            Rule(
                "clip ratio",
                5,
                lambda r, first: _outside(_value(r, "clip_ratio/region_mean_last"), 0.05, 0.3),
                lambda r: (
                    f"clip_ratio/region_mean_last={_value(r, 'clip_ratio/region_mean_last'):.1%}: the last "
                    "update of each rollout clipped outside the healthy 5%-30% of its tokens, 5 steps in a "
                    "row (trainer.num_iterations > 1). Above 30%: the updates are too "
                    "large (lower optimizer.learning_rate or raise loss.epsilon); below 5%: too small (raise "
                    "optimizer.learning_rate)."
                ),
            )
        )
    return found


class HealthMonitor:
    """Feed it every step's metrics row (`check`); it returns the warnings to print now."""

    def __init__(
        self,
        *,
        num_iterations: int = 1,
        beta: float = 0.0,
        dynamic_sampling: bool = False,
        enabled: bool = True,
        resume_step: int = 0,
        mismatch_tolerance: float = 0.0,  # the sampler's declared mean tolerance
    ):
        self.rules = rules(num_iterations, beta, dynamic_sampling, mismatch_tolerance) if enabled else []
        self.first: Row | None = None
        self.resume_step = resume_step

    def check(self, row: Row) -> list[str]:
        if self.first is None and math.isfinite(_entropy(row)):  # the baseline: the first row of a step
            self.first = row
        said = []
        for rule in self.rules:
            if not rule.holds(row, self.first or {}):  # (NaN compares false: a missing metric never holds)
                rule.streak = 0
                continue
            rule.streak += 1
            if rule.streak >= rule.steps:
                rule.held.append(row["step"])
                if not rule.said:
                    rule.said = True
                    said.append(f"warning (step {row['step']}): {rule.message(row)}")
        return said

    @property
    def seen(self) -> list[Rule]:
        return [rule for rule in self.rules if rule.said]

    def summary(self) -> str:
        """One line per kind that held: on how many steps, from which to which."""
        lines = [
            f"  - {rule.name}: {len(rule.held)} step{'s' if len(rule.held) != 1 else ''} "
            f"({rule.held[0]}-{rule.held[-1]})"
            for rule in self.seen
        ]
        first = f" since step {self.resume_step} (resumed)" if self.resume_step else ""
        return (
            "health warnings in this run"
            + first
            + " (each said once above, with its fix):\n"
            + "\n".join(lines)
        )
