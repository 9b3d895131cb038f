"""Metrics rows: `metrics.jsonl` in the run folder (and, with trainer.report_to, TensorBoard
scalars, W&B or Trackio under the same names), a rich progress bar and a compact table; the
completions of each step in `completions.jsonl` (samples.py) with a samples table beside it."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from grpo_cli.files import write_atomic, write_error
from grpo_cli.samples import SAMPLES_FILE, showcase, showcase_table
from grpo_cli.trackers import Start, Trackers

METRICS_FILE = "metrics.jsonl"
# The run's events, one JSON line each ({"step", "kind", "text", ...}): a step skipped for want of a
# group with signal ("skipped"), a non-finite loss or gradient ("nonfinite"), a health warning
# ("health"), a step over the memory plan ("memory"), a checkpoint written ("checkpoint", with its
# "seconds"). grpo-report's timeline marks them (plots.timeline_figure).
EVENTS_FILE = "events.jsonl"
EVENT_KINDS = ("skipped", "nonfinite", "health", "memory", "checkpoint")
# Columns of the console table (all of them go to metrics.jsonl).
TABLE_COLUMNS = (
    "step",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "kl",
    "grad_norm",
    "completions/mean_length",
    "clip_ratio/region_mean",
    "step_time",
    "eval/accuracy",
    "eval_wide/accuracy",
)
SHORT = {
    "reward_std": "r_std",
    "frac_reward_zero_std": "zero_std",
    "grad_norm": "gnorm",
    "completions/mean_length": "len",
    "clip_ratio/region_mean": "clip",
    "step_time": "s/step",
    "eval/accuracy": "eval_acc",
    "eval_wide/accuracy": "wide_acc",
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


class MetricsLogger:
    """Appends one JSON row per logged step; on resume, rows past the resumed step are dropped
    so the file reads as if the run had never stopped."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        quiet: bool,
        table_every: int = 10,
        resume_step: int = 0,
        resume_sft_step: int | None = None,
        report_to: Sequence[str] = ("jsonl",),
        writer: bool = True,
        run_name: str = "",
        run_config: dict | None = None,
    ):
        """writer=False (ranks other than 0 of a multi-process run): nothing is written or printed.
        run_name, run_config: the run's name and resolved config, for W&B and Trackio.
        resume_sft_step: a run resumed before GRPO's first step (resume_step 0), from the
        warm-up's checkpoint of that step (sft-N, or sft-end: its last); None: not resumed there."""
        self.path = run_dir / METRICS_FILE
        self.writer = writer
        quiet = quiet or not writer
        self.quiet = quiet
        self.table_every = table_every
        self.console = Console(stderr=False, quiet=quiet)
        self.rows: list[dict] = []
        self.samples_path = run_dir / SAMPLES_FILE
        self.events_path = run_dir / EVENTS_FILE
        if writer:  # a resumed run drops the lines past its checkpoint; a new one starts afresh
            for path in (self.path, self.samples_path, self.events_path):
                _restart(path, resume_step, resume_sft_step)
        self._pending: list[dict] = []
        self._showcase: list[dict] = []  # the samples table's rows, printed with the metrics table
        # Trackers (trainer.report_to beyond jsonl) get every row under its metrics.jsonl names.
        start = Start(run_dir, run_name or _run_name(run_dir), run_config or {}, resume_step)
        self.trackers = Trackers(report_to if writer else (), start)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            disable=quiet,
            transient=False,
        )
        self.task = self.progress.add_task("training", total=total_steps, completed=resume_step, status="")
        self.phase_task = None  # a stage's own bar before GRPO (the warm-up's)

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        self.trackers.close()
        return False

    def log(self, row: dict[str, Any], table: bool = True) -> None:
        """Append a row (and send it to the trackers); table=False: not in the console's table (a
        warm-up step's row, which says its own line)."""
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" else v)
            for k, v in row.items()
        }
        if not self.writer:
            return
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(clean, allow_nan=True) + "\n")
        except OSError as exc:
            raise write_error(self.path, exc) from exc
        self.trackers.log(clean)
        self.rows.append(clean)
        if table:
            self._pending.append(clean)
        if "reward" in clean:
            status = f"reward {clean['reward']:.3f}  kl {clean.get('kl', float('nan')):.4f}"
            self.progress.update(self.task, completed=clean["step"], status=status)
        if len(self._pending) >= self.table_every:
            self.flush_table()

    def log_samples(self, records: list[dict], show: bool) -> None:
        """A step's completion records to completions.jsonl (texts whole); `show`: also its best and
        worst completion in the console's samples table."""
        if not self.writer or not records:
            return
        try:
            with open(self.samples_path, "a") as fh:
                fh.write("".join(json.dumps(r, ensure_ascii=False, allow_nan=True) + "\n" for r in records))
        except OSError as exc:
            raise write_error(self.samples_path, exc) from exc
        if show and (row := showcase(records)) is not None:
            self._showcase.append(row)
            self.trackers.log_samples(records[0]["step"], records)  # (W&B, Trackio)

    def advance(self, step: int) -> None:
        self.progress.update(self.task, completed=step)

    def set_total(self, total_steps: int) -> None:
        """The run's length changed before its first step (the learnable band kept fewer prompts)."""
        self.progress.update(self.task, total=total_steps)

    def phase(self, description: str, total: int, completed: int) -> None:
        """A bar of its own for a stage before GRPO (the warm-up), `completed` of `total` done."""
        self.phase_task = self.progress.add_task(description, total=total, completed=completed, status="")

    def advance_phase(self, completed: int, status: str) -> None:
        self.progress.update(self.phase_task, completed=completed, status=status)

    def end_phase(self) -> None:
        self.phase_task = None

    def flush_table(self) -> None:
        """Print the metrics of the steps logged since the last table, then their samples."""
        pending, shown, self._pending, self._showcase = self._pending, self._showcase, [], []
        if self.quiet:
            return
        if pending:
            table = Table(box=None, pad_edge=False, header_style="bold")
            for col in TABLE_COLUMNS:
                table.add_column(SHORT.get(col, col), justify="right")
            for row in pending:
                table.add_row(*[_fmt(row.get(col)) for col in TABLE_COLUMNS])
            self.progress.console.print(table)
        if shown:
            self.progress.console.print(showcase_table(shown, width=self.progress.console.width))

    def print(self, *args, **kwargs) -> None:
        self.progress.console.print(*args, **kwargs)

    def warn(self, text: str, *, step: int | None = None, kind: str | None = None) -> None:
        """Warnings and stop messages: to stderr, plain text, even with trainer.quiet=true; with
        a step and an event kind, also an event of the run (events.jsonl)."""
        if not self.writer:
            return
        print(text, file=sys.stderr, flush=True)
        if step is not None and kind is not None:
            self.event(step, kind, text)

    def event(self, step: int, kind: str, text: str = "", **fields: Any) -> None:
        """One line of events.jsonl (EVENTS_FILE's kinds), appended whole."""
        if not self.writer:
            return
        assert kind in EVENT_KINDS, kind
        line = json.dumps({"step": step, "kind": kind, "text": text, **fields}) + "\n"
        try:
            with open(self.events_path, "a") as f:
                f.write(line)
        except OSError as exc:
            raise write_error(self.events_path, exc) from exc


def _run_name(run_dir: Path) -> str:
    """A tracker's name for the run: its folder, relative to the working directory where it lies
    below it (outputs/2026-12-01/10-58-01-<id>, multirun/<...>/0). Unique, unlike the folder's own
    name (a sweep's jobs are 0, 1, ...), since Trackio resumes a run by its name."""
    try:
        return str(run_dir.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(run_dir.resolve())


def _restart(path: Path, resume_step: int, resume_sft_step: int | None = None) -> None:
    """Keep the lines of steps up to `resume_step` (a resumed run), or none (a new run). A run
    resumed before GRPO's first step keeps its step-0 lines up to warm-up step resume_sft_step
    (_position)."""
    try:
        if (resume_step or resume_sft_step is not None) and path.exists():
            at = (resume_step, resume_sft_step if not resume_step else math.inf)
            kept = [line for line in path.read_text().splitlines() if line.strip() and _position(line) <= at]
            write_atomic(path, "".join(line + "\n" for line in kept))
        elif path.exists():
            path.unlink()
    except OSError as exc:
        raise write_error(path, exc) from exc


def _position(line: str) -> tuple[int, float]:
    """Where a metrics line lies in the run: (its step, and for step 0 where before GRPO: the
    start's evaluation 0, warm-up step k at k, the band and the evaluation before GRPO after the
    warm-up); a line cut short by a kill (no newline, bad JSON) lies past everything (dropped)."""
    try:
        row = json.loads(line)
        step = int(row.get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return (1 << 62, 0)
    if step:
        return (step, 0)
    phase = row.get("phase")
    return (0, 0 if phase == "start" else float(row.get("sft/step", 0)) if phase == "sft" else math.inf)


# ----------------------------------------------------------------------------- a step's row

LOSS_STATS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean")
#: grpo_loss's stats that are means over every trained token (the teacher's), not over the loss's.
TRAINED_TOKEN_STATS = ("teacher/kl", "teacher/logp")


class UpdateStats:
    """What the updates of one step did, for its metrics row: grpo_loss's stats as token-weighted
    sums over every micro-batch of every iteration (and of the last iteration alone), the
    entropy, the sampler/trainer log-prob mismatch, each update's loss and pre-clip gradient norm
    (ref 000.7), and the updates skipped (non-finite, or no learning signal)."""

    def __init__(self, grad_scaler: bool = False, variant_stats: tuple[str, ...] = ()) -> None:
        # The token-mean stats of grpo_loss: the shared ones, then the loss variant's own
        # (Variant.stat_names), the same on every rank.
        self.keys = (*LOSS_STATS, *variant_stats)
        self.sums: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.ratio_max = 0.0
        self.entropy_sum = self.entropy_tokens = 0.0
        self.mismatch_sum = self.mismatch_max = self.mismatch_tokens = 0.0
        self.rows = 0.0  # rows through the policy forward in one iteration (what the two above measure)
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.faults: list[str] = []  # the non-finite updates skipped, as lines for the divergence report
        self.no_signal = 0
        # loss.sampler_correction=sequence_mask: the rows it masked (summed over ranks), and whether it ran
        self.masked_rows, self.masking = 0.0, False
        # fp16: updates the grad scaler skipped (an overflow it handles by lowering its scale);
        # None without a scaler (no such column).
        self.scaler_skips: int | None = 0 if grad_scaler else None

    def new_iteration(self) -> None:
        self.last = {}

    def add(self, stats: dict, entropy, mask) -> None:
        """One grpo_loss call's stats, and the entropy [b, C] over its valid tokens (mask [b, C])."""
        n_tok = float(stats["num_tokens"])
        n_trained = float(mask.bool().sum())
        for key in self.keys:  # (the teacher's are means over every trained token, zero-std rows too)
            n = n_trained if key in TRAINED_TOKEN_STATS else n_tok
            self.sums[key] = self.sums.get(key, 0.0) + float(stats[key]) * n
            self.last[key] = self.last.get(key, 0.0) + float(stats[key]) * n
        for name, n in (("num_tokens", n_tok), ("num_trained_tokens", n_trained)):
            self.sums[name] = self.sums.get(name, 0.0) + n
            self.last[name] = self.last.get(name, 0.0) + n
        self.ratio_max = max(self.ratio_max, float(stats["ratio_max"]))
        valid = mask.bool()
        self.entropy_sum += float(entropy[valid].sum())
        self.entropy_tokens += float(valid.sum())

    def add_masked(self, rows: int) -> None:
        """Rows loss.sampler_correction=sequence_mask masked in one micro-batch."""
        self.masked_rows += rows
        self.masking = True

    def add_mismatch(self, check, rows: int) -> None:
        """One micro-batch's |trainer - sampler| log-prob (a selfcheck.LogprobCheck, the one the
        step-0 self-check judges too), over its `rows`."""
        self.mismatch_sum += check.sum_abs_diff
        self.mismatch_max = max(self.mismatch_max, check.max_abs_diff)
        self.mismatch_tokens += float(check.valid_tokens)
        self.rows += rows

    def all_reduce(self, d) -> None:
        """With several processes (distributed.Dist d): the sums over every rank's micro-batches,
        as one process would have them (the losses and gradient norms are already the step's)."""
        if not d.enabled:
            return
        keys = [
            *self.keys,
            "num_tokens",
            "num_trained_tokens",
        ]  # the same on every rank (a rank may train on none)
        scalars = ("entropy_sum", "entropy_tokens", "mismatch_sum", "mismatch_tokens", "rows", "masked_rows")
        summed = d.sum(
            [self.sums.get(k, 0.0) for k in keys]
            + [self.last.get(k, 0.0) for k in keys]
            + [getattr(self, name) for name in scalars]
        )
        self.sums = dict(zip(keys, summed[: len(keys)]))
        self.last = dict(zip(keys, summed[len(keys) : 2 * len(keys)]))
        for name, value in zip(scalars, summed[2 * len(keys) :]):
            setattr(self, name, value)
        self.ratio_max, self.mismatch_max = d.max([self.ratio_max, self.mismatch_max])

    def update(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def row(self) -> dict[str, Any]:
        """The row's share; the `_last` columns when the step ran several updates
        (trainer.num_iterations: one loss each)."""
        n_tok = max(self.sums.get("num_tokens", 0.0), 1.0)
        n_last = max(self.last.get("num_tokens", 0.0), 1.0)
        return (
            {
                **{
                    key: self.sums.get(key, 0.0)
                    / (
                        max(self.sums.get("num_trained_tokens", 0.0), 1.0)
                        if key in TRAINED_TOKEN_STATS
                        else n_tok
                    )
                    for key in self.keys
                },
                "ratio_max": self.ratio_max,
                **(
                    {
                        f"{key}_last": self.last.get(key, 0.0) / n_last
                        for key in ("clip_ratio/region_mean", "ratio_mean")
                    }
                    if len(self.losses) > 1
                    else {}
                ),
                # Over the rows trained on (num_rows_trained: zero-std groups skip the forward under
                # loss.zero_std=mask); NaN on a step that trained on none.
                "sampler/logp_diff_mean": self.mismatch_sum / self.mismatch_tokens
                if self.mismatch_tokens
                else math.nan,
                "sampler/logp_diff_max": self.mismatch_max if self.mismatch_tokens else math.nan,
                "entropy": self.entropy_sum / self.entropy_tokens if self.entropy_tokens else math.nan,
                "num_rows_trained": int(self.rows),
                # Means over the step's num_iterations updates (pre-clip norms, ref 000.7).
                "grad_norm": sum(self.grad_norms) / len(self.grad_norms),
                "grad_norm_max": max(self.grad_norms),
                "loss": sum(self.losses) / len(self.losses),
                "skipped_updates": len(self.faults) + self.no_signal + (self.scaler_skips or 0),
                "skipped_updates/nonfinite": len(self.faults),
                "skipped_updates/no_signal": self.no_signal,
            }
            | ({} if self.scaler_skips is None else {"skipped_updates/grad_scaler": self.scaler_skips})
            | (
                {}
                if not self.masking
                else {"sequence_mask/masked": self.masked_rows / max(self.rows, 1.0)}  # share of rows trained
            )
        )


def pass_rate_histogram(passed: list[bool], G: int) -> list[int]:
    """How many groups of G completions had 0, 1, ..., G passing ones (rewards.passes)."""
    hist = [0] * (G + 1)
    for g in range(len(passed) // G):
        hist[sum(passed[g * G : (g + 1) * G])] += 1
    return hist


@dataclass(frozen=True)
class UpdateReport:
    """A step's update as its metrics row reads it: the update's stats, the learning rate the
    optimizer ended with, when the step started (time.perf_counter()) and where its time went
    (phase -> seconds)."""

    stats: UpdateStats
    learning_rate: float
    started: float
    phase: dict[str, float]


def step_row(step: int, batch, sampled, report: UpdateReport) -> dict[str, Any]:
    """One training step's metrics row (TRL's names where TRL has one). `batch` is the scored
    batch trained on (scored.Batch); `sampled` what the step drew in all (step.Sampled: every
    sampled completion scored, the zero-std count); `report`: its update and times. Token counts
    are of the trained tokens (Rollout.trained_mask); lengths count every completion-side token."""

    from grpo_cli.environments.episodes import episode_metrics
    from grpo_cli.rewards import reward_metrics

    drawn = sampled.drawn  # every completion sampled this step (scored.Scored)
    updates, phase = report.stats, report.phase
    r, G, step_time = batch.rollout, batch.num_generations, time.perf_counter() - report.started
    lengths = r.lengths.float()
    rewards = batch.rewards
    trained = r.trained_mask
    return {
        # A reward's log_metric(name, value) calls (TRL's), the step's mean under the name it gave;
        # first, so that a name of grpo-cli's own below keeps grpo-cli's value.
        **{name: statistics.fmean(values) for name, values in drawn.logged.items()},
        "step": step,
        # (nanmean: a completion a reward could not score, Reward.nan_ok, has a NaN total.)
        "reward": float(rewards.nanmean()),
        "reward_std": float(rewards.view(-1, G).std(-1, unbiased=False).nanmean()),
        **reward_metrics(drawn.per_reward()),
        # Groups left out of the loss because a reward could not score one of their completions.
        "rewards/failed_groups": int(rewards.isnan().view(-1, G).any(-1).sum()),
        **drawn.counters,
        "frac_reward_zero_std": sampled.zero_std_groups / max(sampled.groups, 1),
        "num_groups_sampled": sampled.groups,
        # Every completion sampled this step (adaptive rounds and discarded groups included): the
        # budget runs are compared at. Adaptive group sizes: prompts given more rounds, and those of
        # them whose group then held both a pass and a fail.
        "num_completions_sampled": len(drawn.totals),
        "num_groups_resampled": sampled.resampled_groups,
        "num_groups_rescued": sampled.rescued_groups,
        **updates.row(),
        "prompts/mean_length": float(r.prompt_mask.sum(-1).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(r.truncated.float().mean()),
        **episode_metrics(r),
        # The sampled tokens' mean -log p (the sampler's, tempered), every row: a Monte Carlo
        # estimate of the entropy that needs no forward (health's stand-in for `entropy` on a step
        # that trained on no row).
        "sampler/neg_logp_mean": float(-(r.sampler_logps * trained).sum()) / max(float(trained.sum()), 1.0),
        "learning_rate": float(report.learning_rate),
        "step_time": step_time,
        "tokens_per_second": float(trained.sum()) / step_time,
        # Where the step's time went (seconds); policy = forward+backward of all micro-batches.
        **{f"time/{name}": seconds for name, seconds in phase.items()},
        "pass_rate_hist": pass_rate_histogram(drawn.passed.tolist(), G),
    }
