"""One scored record: a rollout with its rewards, built whole by `rewards.score` and never changed.

Training, grpo-train's held-out evaluation and grpo-eval all read a draw's scores from this one
record. Dynamic sampling and adaptive group sizes are selections and concatenations of records
(`select`, `concat`; `gather` joins the ranks'), and the advantages batch (`Batch`) is a record
plus what the advantages add, nothing copied. Its values are float64, so the means computed from them are
the rewards' own Python floats, bit for bit.

    N rows, in groups of rollout.num_generations (G) consecutive rows that share one prompt;
    R configured rewards, in config order (`names`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from grpo_cli.rollout import Rollout, trimmed
from grpo_cli.rollout import concat as concat_rollouts
from grpo_cli.rollout import select as select_rollout


@dataclass(frozen=True)
class Scored:
    """A rollout's rows and their scores (rewards.score builds it; rows: see the module docstring)."""

    rollout: Rollout
    names: tuple[str, ...]  # the R rewards, in config order
    values: torch.Tensor  # [N, R] float64: each reward's value; NaN: none (None: not applicable, or failed)
    totals: torch.Tensor  # [N] float64: the weighted total (NaN: a reward could not score the row)
    passed: torch.Tensor  # [N] bool: the pass rule (rewards.passes)
    applies: torch.Tensor  # [N] bool: the accuracy rule counts the row (accuracy_rows)
    prompt_index: torch.Tensor  # [N] long: the row's prompt, an index into the draw's examples
    # Per reward: time/rewards/<name> (seconds), rewards/<name>/failures and its own counters
    # (rewards/<name>/<key>: a judge's calls, retries). Summed over concatenated draws; over ranks,
    # times are the slowest rank's (`gather`).
    counters: Mapping[str, float] = field(default_factory=dict)
    # What rewards logged with TRL's log_metric: every call's value, by name.
    logged: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # What rewards logged with TRL's log_extra: a column of completions.jsonl, one value per row
    # (N), by name; rows follow select and concat.
    extra: Mapping[str, tuple] = field(default_factory=dict)
    weights: tuple[float, ...] = ()  # the R rewards' weights, config order (() where unknown)

    def __post_init__(self):
        N = self.rollout.completion_ids.shape[0]
        shapes = {"values": (N, len(self.names)), "totals": (N,), "passed": (N,), "applies": (N,)}
        for name, shape in [*shapes.items(), ("prompt_index", (N,))]:
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Scored.{name}: shape {tuple(getattr(self, name).shape)}, expected {shape}")
        for name, column in self.extra.items():
            if len(column) != N:
                raise ValueError(f"Scored.extra[{name!r}]: {len(column)} values for {N} rows")

    @property
    def num_generations(self) -> int:
        return self.rollout.num_generations

    def column(self, name: str) -> list[float | None]:
        """One reward's values as Python floats, None where it gave none."""
        values = self.values[:, self.names.index(name)].tolist()
        return [None if math.isnan(v) else v for v in values]

    def per_reward(self) -> dict[str, list[float | None]]:
        return {name: self.column(name) for name in self.names}

    def accuracy(self) -> tuple[int, int]:
        """The accuracy rule (docs/evaluation.md): (rows that pass, rows counted). A row counts
        unless the correctness reward found it not applicable (returned None); without a
        correctness reward every row counts and passes when its total is > 0."""
        return int((self.passed & self.applies).sum()), int(self.applies.sum())


def _tensors(record: Scored, fn) -> dict:
    return {
        name: fn(getattr(record, name)) for name in ("values", "totals", "passed", "applies", "prompt_index")
    }


def select(record: Scored, rows: torch.Tensor, num_generations: int | None = None) -> Scored:
    """The rows `rows` [n] (whole groups, or `num_generations` rows of one prompt), without the
    counters and logged values: those are the scoring call's, not its rows', and a draw's are
    counted once however its rows are selected."""
    return replace(
        record,
        rollout=select_rollout(record.rollout, rows, num_generations),
        counters={},
        logged={},
        extra={name: tuple(column[i] for i in rows.tolist()) for name, column in record.extra.items()},
        **_tensors(record, lambda t: t[rows.to(t.device)]),
    )


def concat(records: Sequence[Scored], pad_id: int) -> Scored:
    """Records of one G and the same rewards, stacked in order (rollout.concat pads the widths);
    counters summed, logged values joined."""
    if len(records) == 1:
        return records[0]
    names = {r.names for r in records}
    if len(names) != 1:
        raise ValueError(f"concat: records of different rewards {sorted(names)}")
    counters: dict[str, float] = {}
    logged: dict[str, tuple[float, ...]] = {}
    for r in records:
        for key, value in r.counters.items():
            counters[key] = counters.get(key, 0.0) + value
        for key, values in r.logged.items():
            logged[key] = logged.get(key, ()) + tuple(values)
    columns = dict.fromkeys(name for r in records for name in r.extra)
    extra = {
        name: tuple(v for r in records for v in r.extra.get(name, (None,) * len(r.totals)))
        for name in columns
    }
    return Scored(
        rollout=concat_rollouts([r.rollout for r in records], pad_id),
        names=names.pop(),
        values=torch.cat([r.values for r in records]),
        totals=torch.cat([r.totals for r in records]),
        passed=torch.cat([r.passed for r in records]),
        applies=torch.cat([r.applies for r in records]),
        prompt_index=torch.cat([r.prompt_index for r in records]),
        weights=records[0].weights,
        counters=counters,
        logged=logged,
        extra=extra,
    )


def merge_rank_counters(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Ranks' counters joined: counts summed, seconds (time/...) the slowest rank's (the ranks
    score side by side)."""
    into: dict[str, float] = {}
    for counters in parts:
        for key, value in counters.items():
            into[key] = (
                max(into.get(key, 0.0), value) if key.startswith("time/") else into.get(key, 0.0) + value
            )
    return into


def to(record: Scored, device) -> Scored:
    return replace(record, rollout=record.rollout.to(device), **_tensors(record, lambda t: t.to(device)))


@dataclass(frozen=True)
class Batch:
    """What one step trains on (step.advantages builds it whole, never changed after): the scored
    record of the training groups, plus what the advantages add."""

    scored: Scored
    advantages: torch.Tensor  # [N] per group (loss.group_advantages), detached
    zero_std: torch.Tensor  # [N] bool: the row's group carries no signal
    group_std: torch.Tensor  # [N] the row's group reward std
    # [N, C] the trained tokens that enter the loss: trained_mask, less the rows of truncated
    # completions under loss.mask_truncated_completions.
    loss_mask: torch.Tensor

    @property
    def rollout(self) -> Rollout:
        return self.scored.rollout

    @property
    def rewards(self) -> torch.Tensor:
        """[N] fp32: the weighted totals (the loss's rewards are fp32)."""
        return self.scored.totals.float()

    @property
    def reward_values(self) -> torch.Tensor:
        """[N, R] fp32: each configured reward's value, NaN where it returned None."""
        return self.scored.values.float()

    @property
    def prompt_index(self) -> torch.Tensor:
        """[N] long: the row's prompt, an index into the step's drawn examples."""
        return self.scored.prompt_index

    @property
    def num_generations(self) -> int:
        return self.scored.num_generations

    def rows(self, index: torch.Tensor) -> Batch:
        """A micro-batch: the rows `index` [n] (whole groups), without the prompt columns that are
        padding in all of them and the completion columns past their last attended token."""
        sub = select(self.scored, index)
        r, used = trimmed(sub.rollout)
        return Batch(
            scored=replace(sub, rollout=r),
            advantages=self.advantages[index],
            zero_std=self.zero_std[index],
            group_std=self.group_std[index],
            loss_mask=self.loss_mask[index][:, :used],
        )
