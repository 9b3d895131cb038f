"""Experiment trackers, for trainer.report_to: every row the trainer writes to metrics.jsonl is
also logged by each tracker named there, under the same names ("reward",
"rewards/accuracy/mean", "eval/accuracy", ...) at the row's step; lists (histograms) are left to
metrics.jsonl.

    jsonl        metrics.jsonl itself (always: plots, sweep summaries and resume read it)
    tensorboard  TensorBoard scalars in <run>/tensorboard (trackers/tensorboard.py)
    wandb        a Weights & Biases run (trackers/wandb.py)
    trackio      a Trackio run (trackers/trackio.py)

A tracker is a plug-in (grpo_cli/plugins.py): one module declaring `PLUGIN = Plugin(...)`,
chosen by name in trainer.report_to (a module of this package, by its file name; a user's, by
import path: trainer.report_to=[jsonl,my_pkg.my_tracker]); no config group. What this package
asks of it:

    build(start: Start) -> tracker    once per run, on the writing process; the tracker has
                                      `log(row)`, `close()`, and optionally
                                      `log_samples(step, records)` (a table of completions),
                                      declared by facts.samples
    check(report_to) -> problems      before a run starts: its package installed, credentials
    facts: Facts                      the package it needs (looked up, never imported, by
                                      validation) and whether it logs sample tables

The packages are optional extras (pip install -e '.[wandb]' in grpo-cli's folder, ...), imported only when a
tracker is built: a bad command line is answered before anything heavy loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from grpo_cli import plugins
from grpo_cli.errors import UserError, first_line
from grpo_cli.plugins import Plugin

SAMPLES_KEY = "completions"
# The name that is not a plug-in: metrics.jsonl, which the trainer always writes.
JSONL = "jsonl"


@dataclass(frozen=True)
class Facts:
    """What a tracker declares: the package it needs (None: none beyond grpo-cli's own), what the
    install hint adds, and whether it takes tables of completions (`log_samples`)."""

    package: str | None = None
    install_note: str = ""
    samples: bool = False


@dataclass(frozen=True)
class Start:
    """What a tracker is built with: the run's folder, its name (unique among runs: a sweep's
    jobs are 0, 1, ...), its resolved config, and the step it resumes from (0: a new run)."""

    run_dir: Path
    run_name: str
    config: dict
    resume_step: int = 0


def plugin(name: str) -> Plugin:
    """The declaration of tracker `name` (a module of this package, or a user's import path)."""
    return plugins.load(__name__, name, "trainer.report_to")


def names() -> tuple[str, ...]:
    """The names trainer.report_to takes without an import path."""
    return (JSONL, *plugins.builtin_names(__name__))


class Trackers:
    """The run's trackers (trainer.report_to, jsonl aside), each built once, fed every row."""

    def __init__(self, report_to, start: Start):
        self._built: list[tuple[Plugin, Any]] = []
        try:
            for name in dict.fromkeys(str(n) for n in report_to):  # a name given twice is one tracker
                if name != JSONL:
                    declared = plugin(name)
                    self._built.append((declared, declared.build(start)))
        except BaseException:
            self.close()
            raise

    def log(self, row: dict[str, Any]) -> None:
        for _, tracker in self._built:
            tracker.log(row)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A table of the step's completions, to the trackers that declare they take one."""
        for declared, tracker in self._built:
            if declared.facts.samples:
                tracker.log_samples(step, records)

    def close(self) -> None:
        while self._built:
            _, tracker = self._built.pop()
            tracker.close()


def _install_hint(name: str, report_to: list[str] | None = None) -> str:
    kept = [n for n in dict.fromkeys([JSONL, *(report_to or [])]) if n != name]
    return (
        f"install it with: pip install -e '.[{name}]' in grpo-cli's folder{plugin(name).facts.install_note}, "
        f"or drop it from trainer.report_to (e.g. trainer.report_to=[{','.join(kept)}])."
    )


def missing_package(name: str, report_to: list[str] | None = None) -> str | None:
    """The problem to report when trainer.report_to (the list `report_to`) names the built-in
    tracker `name` and its package is not installed; None when it is. Looks the package up without
    importing it."""
    package = plugin(name).facts.package
    if package is None or find_spec(package) is not None:
        return None
    problem = f"trainer.report_to includes {name}, but the {name} package is not installed; "
    return problem + _install_hint(name, report_to)


# ----------------------------------------------------------------------------- trainer.report_to
# Checked by config validation before a run starts. Packages are looked up, never imported
# (missing_package): wandb and trackio take seconds to import.


def check_report_to(report_to: list[str]) -> list[str]:
    """trainer.report_to's problems: unknown names, no jsonl, each tracker's own (a missing
    package, W&B that would ask for a login)."""
    names_given = [str(name) for name in report_to]
    shown = f"trainer.report_to=[{','.join(names_given)}]"
    problems = _jsonl_required(names_given, shown)
    unknown = []
    for name in dict.fromkeys(names_given):  # a name given twice is one tracker
        if name == JSONL:
            continue
        try:
            declared = plugin(name)
        except UserError as exc:
            unknown.append(name) if not plugins.is_import_path(name) else problems.append(str(exc))
            continue
        problems += declared.problems(names_given)
    if unknown:
        problems.insert(
            0,
            f"{shown}: unknown {'name' if len(unknown) == 1 else 'names'} {', '.join(unknown)}; the "
            f"valid names are {', '.join(names())} (e.g. trainer.report_to=[jsonl,tensorboard]), or "
            "the import path of a tracker of yours (a module declaring PLUGIN).",
        )
    return problems


def _jsonl_required(names_given: list[str], shown: str) -> list[str]:
    if JSONL in names_given:
        return []
    return [
        f"{shown} must include jsonl: metrics.jsonl is what the plots, sweep summaries and "
        "trainer.resume read; e.g. trainer.report_to=[jsonl,tensorboard]."
    ]


def import_error(name: str, exc: ImportError) -> UserError:
    return UserError(
        f"trainer.report_to includes {name}, but it cannot be imported ({first_line(exc)}); "
        + _install_hint(name)
    )


def numbers(row: dict[str, Any]) -> dict[str, float | int]:
    """The row's numeric values, by name, without "step" (bool is an int subclass: not a metric)."""
    return {
        key: value
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _cells(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A sample record as table cells: nested dicts flattened ("rewards/accuracy"), other values
    that are not str/number/bool/None (a chat prompt's messages) as JSON text, so each column
    holds one type."""
    cells: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            cells.update(_cells(value, f"{name}/"))
        elif value is None or isinstance(value, (str, int, float, bool)):
            cells[name] = value
        else:
            cells[name] = json.dumps(value, ensure_ascii=False, default=str)
    return cells


def _rows(records: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """Columns (every key, in first-seen order) and rows of a samples table."""
    flat = [_cells(record) for record in records]
    columns = list(dict.fromkeys(key for cells in flat for key in cells))
    return columns, [[cells.get(col) for col in columns] for cells in flat]


def log_row(run, row: dict[str, Any]) -> None:
    """A metrics row's numbers to a W&B or Trackio run (both take run.log(dict, step=))."""
    metrics = numbers(row)
    if metrics:
        run.log(metrics, step=int(row["step"]))


def log_table(run, table, step: int, records: list[dict]) -> None:
    """Sample records as a `table` (wandb.Table or trackio.Table: one row per record, a column
    per key) named "completions" at `step`."""
    if records:
        columns, rows = _rows(records)
        run.log({SAMPLES_KEY: table(columns=columns, data=rows)}, step=step)


from grpo_cli.trackers.trackio import Trackio  # noqa: E402 (re-exported: the classes by name)
from grpo_cli.trackers.wandb import Wandb  # noqa: E402

__all__ = [
    "SAMPLES_KEY",
    "Facts",
    "Start",
    "Trackio",
    "Wandb",
    "Trackers",
    "check_report_to",
    "missing_package",
    "plugin",
]
