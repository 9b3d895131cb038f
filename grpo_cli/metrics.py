"""Metrics rows: `metrics.jsonl` in the run folder (and TensorBoard scalars under the same names,
with trainer.report_to=[jsonl,tensorboard]), a rich progress bar and a compact table."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grpo_cli.errors import UserError, first_line

# Columns of the console table (all of them go to metrics.jsonl).
TABLE_COLUMNS = ("step", "reward", "reward_std", "frac_reward_zero_std", "kl", "grad_norm",
                 "completions/mean_length", "clip_ratio/region_mean", "step_time", "eval/accuracy")
SHORT = {"reward_std": "r_std", "frac_reward_zero_std": "zero_std", "grad_norm": "gnorm",
         "completions/mean_length": "len", "clip_ratio/region_mean": "clip", "step_time": "s/step",
         "eval/accuracy": "eval_acc"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


class MetricsLogger:
    """Appends one JSON row per logged step; on resume, rows past the resumed step are dropped
    so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: Path, *, total_steps: int, quiet: bool, table_every: int = 10,
                 resume_step: int = 0, report_to: Sequence[str] = ("jsonl",)):
        self.path = run_dir / "metrics.jsonl"
        self.quiet = quiet
        self.table_every = table_every
        self.console = Console(stderr=False, quiet=quiet)
        self.rows: list[dict] = []
        try:
            if resume_step and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and _step_of(line) <= resume_step]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept))
                tmp.replace(self.path)
            elif self.path.exists():
                self.path.unlink()
        except OSError as exc:
            raise _write_error(self.path, exc) from exc
        self._pending: list[dict] = []
        self.tensorboard = TensorBoard(run_dir / "tensorboard", resume_step) if "tensorboard" in report_to else None
        self.progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
            console=self.console, disable=quiet, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=resume_step, status="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        if self.tensorboard is not None:
            self.tensorboard.close()
        return False

    def log(self, row: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" else v)
                 for k, v in row.items()}
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(clean, allow_nan=True) + "\n")
        except OSError as exc:
            raise _write_error(self.path, exc) from exc
        if self.tensorboard is not None:
            self.tensorboard.log(clean)
        self.rows.append(clean)
        self._pending.append(clean)
        if "reward" in clean:
            status = f"reward {clean['reward']:.3f}  kl {clean.get('kl', float('nan')):.4f}"
            self.progress.update(self.task, completed=clean["step"], status=status)
        if len(self._pending) >= self.table_every:
            self.flush_table()

    def advance(self, step: int) -> None:
        self.progress.update(self.task, completed=step)

    def flush_table(self) -> None:
        if not self._pending or self.quiet:
            self._pending = []
            return
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in TABLE_COLUMNS:
            table.add_column(SHORT.get(col, col), justify="right")
        for row in self._pending:
            table.add_row(*[_fmt(row.get(col)) for col in TABLE_COLUMNS])
        self.progress.console.print(table)
        self._pending = []

    def print(self, *args, **kwargs) -> None:
        self.progress.console.print(*args, **kwargs)

    def warn(self, text: str) -> None:
        """Warnings and stop messages: to stderr, plain text, even with trainer.quiet=true."""
        print(text, file=sys.stderr, flush=True)


class TensorBoard:
    """Each row's numbers as TensorBoard scalars, named as in metrics.jsonl, in `log_dir`."""

    def __init__(self, log_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UserError(f"trainer.report_to includes tensorboard, but it cannot be imported ({first_line(exc)}); "
                            "install it with: pip install 'grpo-cli[tensorboard]', or drop it: "
                            "trainer.report_to=[jsonl].") from exc
        try:
            # A resumed run hides the events logged after its checkpoint, as metrics.jsonl drops those rows.
            self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step else None)
        except OSError as exc:
            raise _write_error(log_dir, exc) from exc

    def log(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()  # readable while the run goes on

    def close(self) -> None:
        self.writer.close()


def _step_of(line: str) -> int:
    """The step of a metrics line; a line cut short by a kill (no newline, bad JSON) is dropped."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62


def _write_error(path: Path, exc: OSError) -> UserError:
    return UserError(f"could not write {path}: {first_line(exc)}. Free disk space or point hydra.run.dir at a "
                     "writable disk with room.")


def all_finite(row: dict[str, Any]) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))
