"""The sweep job wrapper of grpo-train. How a job ends: failures worded for the user, and sweeps
that outlive their jobs.

A single run prints its failure and exits with its status (grpo_cli/errors.py). In a sweep
(`grpo-train -m`: Hydra's basic launcher runs the jobs one after another in this process) a
failing job must not stop the others. Hydra 1.3.8 does not give that by itself: its launcher
catches an Exception from a job, but the sweeper re-raises the first one once all the jobs have
run (so a callback's on_multirun_end never runs), and a SystemExit escapes the launcher at once
and ends the sweep. So the task function runs each sweep job through `Sweep.run_job`, which
turns every way a job can end into a record (the job's `status.json`) and releases the job's
memory; `Sweep.finish` then prints and writes the summary and the overlaid plot, and returns the
sweep's exit status. A signal still stops the whole sweep, after summarising the jobs that ran.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from grpo_cli import plots
from grpo_cli.errors import EXIT_USER_ERROR, Interrupted, first_line
from grpo_cli.files import write_atomic
from grpo_cli.summary import STATUS_FILE, jobs, print_summary, summarise_sweep, write_summary

EXIT_INTERRUPTED = (130, 143)  # 128 + SIGINT, 128 + SIGTERM


class RunFailed(Exception):
    """A failure worded for the user (`title: problem`, or the title and one bullet per
    problem) and the exit status it ends a single run with (2 bad input, 3 diverged)."""

    def __init__(self, title: str, problems: list[str], code: int = EXIT_USER_ERROR):
        super().__init__(problems[0] if problems else title)
        self.title, self.problems, self.code = title, problems, code

    def message(self) -> str:
        """The text errors.report_and_exit prints for the same title and problems."""
        if len(self.problems) == 1:
            return f"{self.title}: {self.problems[0]}"
        return "\n".join(
            [f"{self.title} ({len(self.problems)} problems):"] + [f"  - {p}" for p in self.problems]
        )

    def summary_line(self) -> str:
        """One line for a summary: what failed and the first line of the first problem."""
        what = self.title.partition(": ")[2]
        first = self.problems[0].strip().splitlines()[0] if self.problems else ""
        more = f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
        return f"{what}: {first}{more}" if what else f"{first}{more}"


def release_memory() -> None:
    """Free what a finished job left behind: its objects now, then the CUDA allocator's cache."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return f"exit status {code}"


class Sweep:
    """The jobs of one multirun, in the order they ran, and how each ended."""

    def __init__(self, prog: str = "grpo-train"):
        self.prog = prog
        self.dir: Path | None = None
        self.jobs: dict[Path, dict[str, Any]] = {}

    def run_job(
        self, task: Callable[[], None], *, sweep_dir: Path, run_dir: Path, overrides: list[str], num: int
    ) -> None:
        """Run one job; whatever it raises (but a signal) is recorded and the sweep goes on."""
        self.dir = Path(sweep_dir)
        record: dict[str, Any] = {
            "job": num,
            "overrides": list(overrides),
            "status": "completed",
            "exit_code": 0,
            "error": None,
            "started": _now(),
        }
        self.jobs[Path(run_dir)] = record
        start = time.perf_counter()
        try:
            task()
        except RunFailed as exc:
            print(exc.message(), file=sys.stderr, flush=True)
            record.update(status="failed", exit_code=exc.code, error=exc.summary_line())
        except Interrupted as exc:
            record.update(
                status="interrupted", exit_code=exc.exit_code, error=f"stopped by {exc.signal_name}"
            )
            raise
        except SystemExit as exc:  # the engine after a signal (130/143), or code calling sys.exit
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if code in EXIT_INTERRUPTED:
                record.update(status="interrupted", exit_code=code, error=f"stopped by {_signal_name(code)}")
                raise
            if code:
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr, flush=True)
                record.update(status="failed", exit_code=code, error=f"SystemExit: {exc.code}")
        except Exception as exc:  # noqa: BLE001 - a bug or an unworded error: its traceback is shown, the sweep goes on
            traceback.print_exc()
            record.update(status="failed", exit_code=1, error=first_line(exc))
        finally:
            record.update(wall_time_s=round(time.perf_counter() - start, 3), ended=_now())
            if record["status"] == "failed":
                print(
                    f"{self.prog}: job {num} failed (exit status {record['exit_code']}); the sweep goes on.",
                    file=sys.stderr,
                    flush=True,
                )
            self._write_status(Path(run_dir), record)
            release_memory()

    def _write_status(self, run_dir: Path, record: dict[str, Any]) -> None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / STATUS_FILE, json.dumps(record, indent=2) + "\n")
        except OSError as exc:
            print(
                f"{self.prog}: warning: could not write {run_dir / STATUS_FILE}: {first_line(exc)}",
                file=sys.stderr,
                flush=True,
            )

    @property
    def exit_code(self) -> int:
        """0 when every job completed, else the first failed job's exit status."""
        return next((int(r["exit_code"] or 1) for r in self.jobs.values() if r["status"] != "completed"), 0)

    def finish(self, stopped_by: str | None = None) -> int:
        """Print the summary of the jobs that ran, write summary.csv, summary.json and
        summary.png in the sweep folder; return the sweep's exit status. Once per sweep (0 and
        nothing done when no sweep ran)."""
        if self.dir is None:
            return 0
        sweep_dir, self.dir = self.dir, None
        summary = summarise_sweep(sweep_dir, statuses=self.jobs, run_dirs=list(self.jobs))
        title = f"sweep {sweep_dir}: {jobs(len(self.jobs))}" + (
            f" (stopped by {stopped_by}; the jobs after the last one did not run)" if stopped_by else ""
        )
        print_summary(summary, title)
        written = []
        try:
            written = write_summary(summary, sweep_dir)
        except OSError as exc:
            print(
                f"{self.prog}: warning: could not write the summary in {sweep_dir}: {first_line(exc)}",
                file=sys.stderr,
                flush=True,
            )
        png = plots.draw_safely(
            plots.draw_sweep,
            sweep_dir,
            [(row["label"], Path(row["run_dir"])) for row in summary.rows],
            title=f"sweep {sweep_dir}",
            prog=self.prog,
        )
        if written or png:
            print(f"summary: {', '.join(str(p) for p in [*written, *([png] if png else [])])}", flush=True)
        return self.exit_code
