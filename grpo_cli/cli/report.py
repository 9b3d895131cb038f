"""`grpo-report PATH...`: the summary tables and plots of existing run or sweep folders, again.

A run folder (it holds metrics.jsonl) gets its metrics.png; a sweep folder (its job folders hold
metrics.jsonl or status.json) gets summary.csv, summary.json, summary.png and each job's
metrics.png. Run folders given together share one table. It works while a run is still
writing: a last metrics line cut short is skipped. Exit 2 with one paragraph when a path is
neither.

`grpo-report RUN --samples STEP` (or `last`) prints the completions the run logged at that step
instead (completions.jsonl: each reward, the total, advantage, length, truncated, zero-std).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo_cli import plots
from grpo_cli.errors import EXIT_USER_ERROR, first_line
from grpo_cli.metrics import METRICS_FILE
from grpo_cli.samples import SAMPLES_FILE, read_records, records_table, shorten
from grpo_cli.summary import (
    best_line,
    is_run_dir,
    is_sweep_dir,
    jobs,
    print_summary,
    read_metrics,
    summarise,
    summarise_sweep,
    write_summary,
)

PROG = "grpo-report"
WHERE = (
    "Give a folder that grpo-train wrote: a run folder (outputs/<date>/<time>-<id>, holding metrics.jsonl) "
    "or a sweep folder (multirun/<date>/<time>-<id>, holding one folder per job)."
)


def classify(path: Path) -> tuple[str, Path]:
    """('run' | 'sweep', folder) for a path grpo-report can render; UsageError otherwise."""
    if path.is_file() and path.name == METRICS_FILE:
        return "run", path.parent
    if not path.exists():
        raise UsageError(f"{path} does not exist.")
    if not path.is_dir():
        raise UsageError(f"{path} is a file, not a run or sweep folder.")
    if is_run_dir(path):
        return "run", path
    if is_sweep_dir(path):
        return "sweep", path
    raise UsageError(
        f"{path} is neither a run folder (it has no {METRICS_FILE}) nor a sweep folder (none of "
        "its folders holds a run)."
    )


class UsageError(Exception):
    """A path grpo-report cannot render; exit 2."""


def _warn(text: str) -> None:
    print(f"{PROG}: warning: {text}", file=sys.stderr, flush=True)


def report_sweep(sweep_dir: Path) -> list[Path]:
    """Print the sweep's table; write its summary files, its overlaid plot and each job's plot."""
    summary = summarise_sweep(sweep_dir)
    print_summary(summary, f"sweep {sweep_dir}: {jobs(len(summary.rows))}")
    written: list[Path] = []
    try:
        written += write_summary(summary, sweep_dir)
    except OSError as exc:
        _warn(f"could not write the summary in {sweep_dir}: {first_line(exc)}")
    for row in summary.rows:
        written.append(plots.draw_safely(plots.draw_run, Path(row["run_dir"]), prog=PROG))
    written.append(
        plots.draw_safely(
            plots.draw_sweep,
            sweep_dir,
            [(r["label"], Path(r["run_dir"])) for r in summary.rows],
            title=f"sweep {sweep_dir}",
            prog=PROG,
        )
    )
    return [p for p in written if p]


def report_runs(run_dirs: list[Path]) -> list[Path]:
    """Print one table of the runs; write each run's plot."""
    summary = summarise(run_dirs)
    print_summary(summary, f"{len(run_dirs)} run{'s' if len(run_dirs) > 1 else ''}")
    written = []
    for run_dir in run_dirs:
        if not read_metrics(run_dir):
            print(f"{run_dir}: no metrics yet", flush=True)
        if said := best_line(run_dir):  # (chosen on the validation set, reported on the held-out set)
            print(said, flush=True)
        written.append(plots.draw_safely(plots.draw_run, run_dir, prog=PROG))
    return [p for p in written if p]


def print_samples(paths: list[Path], step_arg: str) -> int:
    """Print the completions each run folder logged at one step, a table per group's worth of
    rows, best first within each group; exit status 2 with one paragraph when there are none."""
    from rich.console import Console

    if step_arg != "last" and not step_arg.isdigit():
        print(f"{PROG}: --samples {step_arg!r} must be a step number or 'last'.", file=sys.stderr)
        return EXIT_USER_ERROR
    console = Console()
    for path in paths:
        run_dir = path.parent if path.is_file() else path
        records = read_records(run_dir)
        if not records:
            print(
                f"{PROG}: {run_dir} holds no logged completions ({SAMPLES_FILE} is missing or empty). "
                "grpo-train writes them when trainer.log_completions > 0 (the default).",
                file=sys.stderr,
            )
            return EXIT_USER_ERROR
        steps = sorted({r["step"] for r in records})
        step = steps[-1] if step_arg == "last" else int(step_arg)
        chosen = sorted((r for r in records if r["step"] == step), key=lambda r: (r["group"], -r["reward"]))
        if not chosen:
            print(
                f"{PROG}: {run_dir} logged no completions at step {step}; it logged steps "
                f"{steps[0]}-{steps[-1]} ({len(steps)} steps).",
                file=sys.stderr,
            )
            return EXIT_USER_ERROR
        names = list(chosen[0]["rewards"])
        for group in sorted({r["group"] for r in chosen}):
            members = [r for r in chosen if r["group"] == group]
            console.print(
                f"[bold]{run_dir}, step {step}, group {group}:[/bold] {shorten(members[0]['prompt'], 200)}",
                soft_wrap=True,
                markup=True,
                highlight=False,
            )
            console.print(records_table(members, names, width=200))
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Print the summary table and redraw the plots of grpo-train run or sweep folders (also while they run): "
            "metrics.png per run; summary.csv, summary.json and summary.png per sweep."
        ),
    )
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="a run folder or a sweep folder")
    parser.add_argument(
        "--samples",
        metavar="STEP",
        help="print the completions a run logged at STEP (completions.jsonl; 'last' for its latest step) "
        "instead of the summary",
    )
    args = parser.parse_args(argv)
    if args.samples is not None:
        sys.exit(print_samples(args.paths, args.samples))
    found, problems = [], []
    for path in args.paths:
        try:
            found.append(classify(path))
        except UsageError as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(f"{path} cannot be read ({first_line(exc)}).")
    if problems:
        print(f"{PROG}: " + " ".join(problems) + " " + WHERE, file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    written: list[Path] = []
    runs = [folder for kind, folder in found if kind == "run"]
    if runs:
        written += report_runs(runs)
    for kind, folder in found:
        if kind == "sweep":
            written += report_sweep(folder)
    if written:
        print("wrote: " + ", ".join(map(str, written)), flush=True)


if __name__ == "__main__":
    main()
