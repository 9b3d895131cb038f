"""Evaluation that decides: the best checkpoint and early stopping, read on the validation set.

`decide` is the one rule, a pure function: the state kept in the run (`Progress`, saved in
TrainerState so a resume goes on counting where it stopped) and one evaluation's value of
trainer.best_metric in, the next state and what to do out. Its contract:

- Higher is better. A value improves on the best when it is above it (the first evaluation always
  does); an equal value is no improvement, so a plateau counts toward the patience.
- trainer.early_stopping_target: stop at the first evaluation whose value reaches it (>=).
- trainer.early_stopping_patience: stop once this many evaluations in a row did not improve on the
  best (patience 2: best at step 8, no better at 16 and 24 -> stop at 24).
- A missing value (the metric absent from the row: nothing to count) changes nothing.

The metric is read on a validation set of its own (data.val_size rows carved from the training
rows, never trained on), never on the held-out set the run reports: choosing a checkpoint on the
set one reports would inflate the result.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Progress:
    """Where the run stands on trainer.best_metric: the best value and its step (0: none yet), the
    held-out accuracy logged at that step (for the last lines), the evaluations since it improved."""

    best: float = -math.inf
    best_step: int = 0
    best_held_out: float | None = None
    since_best: int = 0
    stopped_at: int = 0  # the step early stopping ended the run at (0: it has not)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Progress:
        return cls(**data) if data else cls()


@dataclass(frozen=True)
class Decision:
    progress: Progress
    improved: bool  # a new best: write checkpoints/best
    stop: bool  # early stopping ends the run at this step
    reason: str  # why it stops ("" when it does not)


def decide(
    progress: Progress,
    value: float | None,
    step: int,
    *,
    patience: int | None,
    target: float | None,
    held_out: float | None = None,
    metric: str = "val/accuracy",
) -> Decision:
    """The next state after one evaluation (the module docstring's contract)."""
    if value is None or not math.isfinite(value):
        return Decision(progress, False, False, "")
    improved = value > progress.best
    if improved:
        progress = replace(progress, best=value, best_step=step, best_held_out=held_out, since_best=0)
    else:
        progress = replace(progress, since_best=progress.since_best + 1)
    reason = ""
    if target is not None and value >= target:
        reason = f"{metric} {value:.4g} reached trainer.early_stopping_target={target:g}"
    elif patience is not None and progress.since_best >= patience:
        reason = (
            f"{metric} did not improve on its best ({progress.best:.4g} at step {progress.best_step}) in "
            f"{progress.since_best} evaluation{'s' if progress.since_best != 1 else ''} "
            f"(trainer.early_stopping_patience={patience})"
        )
    if reason:
        progress = replace(progress, stopped_at=step)
    return Decision(progress, improved, bool(reason), reason)


def check_early(cfg) -> list[str]:
    """The settings' rules (config.validate collects them): the metric is a validation one, and
    early stopping needs a validation set and evaluations during the run."""
    t, problems = cfg.trainer, []
    metric = str(t.best_metric)
    if not metric.startswith("val/"):
        problems.append(
            f"trainer.best_metric={metric!r} must be a validation metric (val/accuracy, val/reward, ...): the best "
            "checkpoint and early stopping read data.val_size's rows, never the held-out set the run reports."
        )
    patience, target = t.early_stopping_patience, t.early_stopping_target
    if patience is not None and patience < 1:
        problems.append(
            f"trainer.early_stopping_patience={patience} must be >= 1 evaluations, or null (off)."
        )
    if target is not None and not math.isfinite(target):
        problems.append(f"trainer.early_stopping_target={target} must be a finite number, or null (off).")
    if (patience is not None or target is not None) and cfg.data.val_size < 1:
        problems.append(
            "early stopping (trainer.early_stopping_patience / early_stopping_target) reads a validation set: set "
            "data.val_size (e.g. 64: rows carved from the training rows, never trained on)."
        )
    if (patience is not None or target is not None) and not t.eval_steps:
        problems.append(
            "early stopping decides at each evaluation, and trainer.eval_steps=0 evaluates only at the end: set "
            "trainer.eval_steps (e.g. 8)."
        )
    if t.eval_temperature is not None and not (t.eval_temperature > 0 and math.isfinite(t.eval_temperature)):
        problems.append(
            f"trainer.eval_temperature={t.eval_temperature} must be > 0, or null (the sampler's temperature); "
            "greedy accuracy is always reported."
        )
    elif t.eval_temperature is not None and not t.eval_samples:
        problems.append(
            f"trainer.eval_temperature={t.eval_temperature} sets the sampled evaluation's temperature, and "
            "trainer.eval_samples=0 samples none: set trainer.eval_samples (e.g. 4)."
        )
    if t.eval_start < 0:
        problems.append(
            f"trainer.eval_start={t.eval_start} must be >= 0 (the first step evaluated during the run)."
        )
    return problems
