"""Run and sweep summaries: what the run folders say, as one row per run.

A run folder holds `metrics.jsonl` (one JSON row per logged step; its last line may be cut
short while the run is still writing it: such a line is skipped) and, for a sweep job,
`status.json` (how the job ended, written by grpo_cli/cli/sweep.py). A sweep folder holds one run
folder per job. A summary row holds the job's overrides, the final and best values of the
headline metrics, the steps trained, the wall time and the status; a sweep's rows are printed
as a rich table and written as `summary.csv` and `summary.json` in the sweep folder.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpo_cli.files import write_atomic
from grpo_cli.metrics import METRICS_FILE

STATUS_FILE = "status.json"
OVERRIDES_FILE = "overrides.yaml"
SWEEP_FILE = "multirun.yaml"  # Hydra's record of a sweep, written in the sweep folder

# (metric, column prefix, name of the second value, how it is taken). Higher reward and accuracy
# are better; kl and completion length have no better direction, so their peak is shown.
HEADLINE: tuple[tuple[str, str, str, Callable[[list[float]], float]], ...] = (
    ("reward", "reward", "best", max),
    ("eval/accuracy", "eval_accuracy", "best", max),
    ("eval_wide/accuracy", "eval_wide_accuracy", "best", max),
    ("kl", "kl", "max", max),
    ("completions/mean_length", "length", "max", max),
)
HEADERS = (
    "reward\nfinal/best",
    "eval acc\nfinal/best",
    "wide acc\nfinal/best",
    "kl\nfinal/max",
    "length\nfinal/max",
)
COLUMNS = (
    "job",
    "label",
    "status",
    "exit_code",
    "steps",
    *[f"{prefix}_{which}" for _, prefix, second, _ in HEADLINE for which in ("final", second)],
    "wall_time_s",
    "error",
    "overrides",
    "run_dir",
)
FAILED = ("failed", "interrupted")


# ----------------------------------------------------------------------------- reading


def best_line(run_dir: Path) -> str | None:
    """A run's best step (checkpoints/best/best.json, chosen on the validation set) with the
    held-out accuracy there and at the run's last evaluation: what the run reports for the
    checkpoint it chose and for the one it ended with. None without a best checkpoint."""
    path = Path(run_dir) / "checkpoints" / "best" / "best.json"
    try:
        record = json.loads(path.read_text())
        metric, value, step = record["metric"], float(record["value"]), int(record["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r and r.get("step", 0) > 0]
    there = next((r["eval/accuracy"] for r in evals if r["step"] == step), None)
    held = ""
    if there is not None and evals:
        held = (
            f"; held-out accuracy there {there:.3f}, at the end (step {evals[-1]['step']}) "
            f"{evals[-1]['eval/accuracy']:.3f}"
        )
    return f"{run_dir}: best step {step} ({metric} {value:.3f}){held}; {path.parent}"


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events (metrics.EVENTS_FILE), oldest first; [] for a run without any."""
    from grpo_cli.metrics import EVENTS_FILE

    return read_metrics(run_dir, EVENTS_FILE)


def read_metrics(run_dir: Path, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The rows of `run_dir/metrics.jsonl` (or of another of the run's JSON Lines files), oldest
    first; a line that is not a whole JSON row (the last one, while the run writes it) is skipped."""
    try:
        text = (Path(run_dir) / name).read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one numeric metric, for the rows that have it."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def read_status(run_dir: Path) -> dict[str, Any]:
    """A sweep job's `status.json`, or {} when there is none (a single run, or a job that is
    still running or was killed)."""
    try:
        data = json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides grpo-train saved in the run folder, or []."""
    import yaml

    try:
        data = yaml.safe_load((Path(run_dir) / OVERRIDES_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(item) for item in data] if isinstance(data, list) else []


def is_run_dir(path: Path) -> bool:
    return any((Path(path) / name).is_file() for name in (METRICS_FILE, STATUS_FILE))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The run folders of a sweep, in job order (Hydra names them 0, 1, 2, ...)."""
    found = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and is_run_dir(p)]
    return sorted(found, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def is_sweep_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / SWEEP_FILE).is_file() or bool(job_dirs(path)))


# ----------------------------------------------------------------------------- summarising


def _finite(value: float | None) -> float | None:
    """A value for the summary: 6 significant digits (float32 metrics carry noise past that),
    None when it is not finite."""
    return float(f"{value:.6g}") if value is not None and math.isfinite(value) else None


def summarise_run(
    run_dir: Path, status: dict[str, Any] | None = None, *, no_status: str = "-"
) -> dict[str, Any]:
    """One summary row for a run folder; `status` (else its status.json) says how it ended,
    `no_status` is shown when nothing does."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    status = status if status is not None else read_status(run_dir)
    trained = [row["step"] for row in rows if "reward" in row]
    out: dict[str, Any] = {
        "job": status.get("job", int(run_dir.name) if run_dir.name.isdigit() else run_dir.name),
        "label": "",
        "status": status.get("status", no_status),
        "exit_code": status.get("exit_code"),
        "steps": max(trained) if trained else 0,
        "wall_time_s": status.get("wall_time_s"),
        "error": status.get("error"),
        "overrides": list(status.get("overrides") or read_overrides(run_dir)),
        "run_dir": str(run_dir),
    }
    for key, prefix, second, take in HEADLINE:
        _, values = series(rows, key)
        finite = [v for v in values if math.isfinite(v)]
        out[f"{prefix}_final"] = _finite(values[-1]) if values else None
        out[f"{prefix}_{second}"] = _finite(take(finite)) if finite else None
    return out


@dataclass
class Summary:
    """Rows of runs side by side, with what they share and which one did best."""

    rows: list[dict[str, Any]]
    common: list[str] = field(default_factory=list)  # overrides every run shares
    best: int | None = None  # index of the best row (highest final eval accuracy, then reward)
    tie: bool = False  # several runs share the best values: none is named
    sweep_dir: Path | None = None

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if row["status"] in FAILED]

    @property
    def exit_code(self) -> int:
        """0 when no run failed, else the first failed run's exit status (1 when unknown)."""
        return next((int(row["exit_code"] or 1) for row in self.failed), 0)


def summarise(
    run_dirs: list[Path],
    statuses: dict[Path, dict[str, Any]] | None = None,
    *,
    no_status: str = "-",
    sweep_dir: Path | None = None,
) -> Summary:
    """Summary rows of several runs: each row is labelled by the overrides that differ between
    the runs (the ones every run shares are `common`)."""
    statuses = statuses or {}
    rows = [summarise_run(d, statuses.get(Path(d)), no_status=no_status) for d in run_dirs]
    common = (
        [o for o in rows[0]["overrides"] if all(o in row["overrides"] for row in rows)]
        if len(rows) > 1
        else []
    )
    for row in rows:
        row["label"] = " ".join(o for o in row["overrides"] if o not in common) or "(no overrides)"
    best, tie = _best(rows)
    return Summary(rows=rows, common=common, best=best, tie=tie, sweep_dir=sweep_dir)


def summarise_sweep(
    sweep_dir: Path, statuses: dict[Path, dict[str, Any]] | None = None, run_dirs: list[Path] | None = None
) -> Summary:
    """The summary of a sweep folder: every job folder in it, or just `run_dirs`. A job with no
    status.json is `unfinished` (still running, or killed)."""
    dirs = run_dirs if run_dirs is not None else job_dirs(sweep_dir)
    return summarise(dirs, statuses, no_status="unfinished", sweep_dir=Path(sweep_dir))


def _best(rows: list[dict[str, Any]]) -> tuple[int | None, bool]:
    """The index of the best row (highest final eval accuracy, then final reward) among the
    runs that did not fail, and whether several tie for it (then there is no best)."""

    def key(i: int) -> tuple[float, float]:
        row = rows[i]
        acc, reward = row["eval_accuracy_final"], row["reward_final"]
        return (acc if acc is not None else -math.inf, reward if reward is not None else -math.inf)

    candidates = [
        i for i, row in enumerate(rows) if row["status"] not in FAILED and row["reward_final"] is not None
    ]
    if len(candidates) < 2:
        return None, False
    best = max(candidates, key=key)
    if sum(key(i) == key(best) for i in candidates) > 1:
        return None, True
    return best, False


# ----------------------------------------------------------------------------- writing


def to_json(summary: Summary) -> str:
    best = summary.rows[summary.best]["job"] if summary.best is not None else None
    data = {
        "sweep_dir": str(summary.sweep_dir) if summary.sweep_dir else None,
        "common_overrides": summary.common,
        "best_job": best,
        "exit_code": summary.exit_code,
        "jobs": [{k: row[k] for k in COLUMNS} for row in summary.rows],
    }
    return json.dumps(data, indent=2) + "\n"


def to_csv(summary: Summary) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in summary.rows:
        writer.writerow(
            {
                k: (" ".join(row[k]) if k == "overrides" else ("" if row[k] is None else row[k]))
                for k in COLUMNS
            }
        )
    return buffer.getvalue()


def write_summary(summary: Summary, folder: Path) -> list[Path]:
    """summary.csv and summary.json in `folder` (each written whole, then renamed into place)."""
    paths = [Path(folder) / "summary.csv", Path(folder) / "summary.json"]
    write_atomic(paths[0], to_csv(summary))
    write_atomic(paths[1], to_json(summary))
    return paths


# ----------------------------------------------------------------------------- printing


def jobs(n: int) -> str:
    return f"{n} job" if n == 1 else f"{n} jobs"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def _pair(row: dict[str, Any], prefix: str, second: str) -> str:
    final, other = row[f"{prefix}_final"], row[f"{prefix}_{second}"]
    return "-" if final is None and other is None else f"{_num(final)}/{_num(other)}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 100:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 6000 else f"{seconds / 3600:.1f} h"


def _status(row: dict[str, Any]) -> str:
    code = row["exit_code"]
    return f"{row['status']} ({code})" if row["status"] in FAILED and code else str(row["status"])


def table(summary: Summary, title: str) -> Table:
    t = Table(
        title=escape(title),
        caption=escape("common: " + " ".join(summary.common)) if summary.common else None,
        header_style="bold",
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("overrides", overflow="fold", min_width=12)
    # A headline column no run has (the wide held-out set's accuracy off) is left out.
    shown = [
        (prefix, second, header)
        for (_, prefix, second, _), header in zip(HEADLINE, HEADERS)
        if any(_pair(row, prefix, second) != "-" for row in summary.rows) or prefix != "eval_wide_accuracy"
    ]
    for header in [h for _, _, h in shown] + ["steps", "wall"]:
        t.add_column(header, justify="right", overflow="fold")
    t.add_column("status", overflow="fold")
    for i, row in enumerate(summary.rows):
        mark = "*" if i == summary.best else ""
        t.add_row(
            f"{row['job']}{mark}",
            escape(row["label"]),
            *[_pair(row, prefix, second) for prefix, second, _ in shown],
            str(row["steps"]),
            _duration(row["wall_time_s"]),
            _status(row),
            style="bold" if mark else ("red" if row["status"] in FAILED else None),
        )
    return t


def notes(summary: Summary) -> list[str]:
    """The lines under the table: the best run and why, and each failure's error."""
    lines = []
    if summary.tie:
        lines.append("no single best run: the top runs tie on final eval/accuracy and final reward")
    if summary.best is not None:
        row = summary.rows[summary.best]
        why = [
            f"{name} {_num(row[f'{prefix}_final'])}"
            for name, prefix in (("eval/accuracy", "eval_accuracy"), ("reward", "reward"))
            if row[f"{prefix}_final"] is not None
        ]
        lines.append(
            f"* best: job {row['job']} ({row['label']}): final {', '.join(why)} "
            "(ranked by final eval/accuracy, then final reward)"
        )
    for row in summary.failed:
        lines.append(f"job {row['job']} {row['status']}: {row['error'] or 'no error recorded'}")
    if summary.failed:
        lines.append(
            f"{len(summary.failed)} of {jobs(len(summary.rows))} did not complete: the sweep's exit "
            f"status is {summary.exit_code} (the first of them)."
        )
    return lines


def console() -> Console:
    """Standard output; as wide as the table needs when it is a file or a pipe (a log file
    does not wrap), unless COLUMNS says otherwise."""
    out = Console()
    return out if out.is_terminal or os.environ.get("COLUMNS") else Console(width=160)


def print_summary(summary: Summary, title: str, out: Console | None = None) -> None:
    out = out or console()
    out.print(table(summary, title))
    for line in notes(summary):
        out.print(line, markup=False, highlight=False)
