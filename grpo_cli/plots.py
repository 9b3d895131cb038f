"""Training curves as small PNG files: `metrics.png` in a run folder, `summary.png` (the runs
overlaid, with a legend of their overrides) in a sweep folder, and `timeline.png` in both (each
step's seconds by phase with its events marked; a sweep's: each run's mean step by phase).

Matplotlib's object API on the Agg canvas: no display, no pyplot state shared between runs.
Plots are a by-product of training: `draw_safely` turns any failure into a one-line warning,
so that it never hides the training result or error.
"""

from __future__ import annotations

import io
import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable

from grpo_cli.errors import first_line
from grpo_cli.files import write_atomic
from grpo_cli.summary import read_events, read_metrics, series

RUN_PLOT = "metrics.png"
SWEEP_PLOT = "summary.png"
TIMELINE_PLOT = "timeline.png"  # a run's (each step's seconds by phase) and a sweep's (per run)
# The phases of a step, in the order they run (time/<phase> in metrics.jsonl; a checkpoint's seconds
# from events.jsonl). "eval": the held-out evaluation of that step.
PHASES = ("rollout", "reward", "reference", "teacher", "policy", "optimizer", "sync", "eval", "checkpoint")
# The timeline's markers: (marker, colour, label) by event kind (metrics.EVENT_KINDS), and "zero_std":
# a step whose every group had one reward (frac_reward_zero_std 1: no learning signal).
MARKERS = {
    "skipped": ("x", "black", "skipped: no group with signal"),
    "zero_std": ("s", "grey", "every group zero-std"),
    "nonfinite": ("v", "red", "non-finite loss or gradient"),
    "health": ("^", "darkorange", "health warning"),
    "memory": ("D", "purple", "over the memory plan"),
}
# Panels: title and the metrics drawn in it. "clip_ratio/*" stands for every clip ratio logged.
RUN_PANELS = (
    ("reward", ("reward",)),
    ("held-out accuracy (greedy)", ("eval/accuracy", "eval_wide/accuracy")),
    ("held-out accuracy by group", ("eval/accuracy/*",)),
    ("kl", ("kl",)),
    ("completion length (tokens)", ("completions/mean_length",)),
    ("clip ratio", ("clip_ratio/*",)),
    ("fraction of zero-std groups", ("frac_reward_zero_std",)),
)
# A sweep overlays one line per run and panel: the main one of each panel.
SWEEP_PANELS = (
    ("reward", ("reward",)),
    ("held-out accuracy (greedy)", ("eval/accuracy",)),
    ("wide held-out accuracy (greedy)", ("eval_wide/accuracy",)),
    *[(t, keys) for t, keys in RUN_PANELS[3:] if keys != ("clip_ratio/*",)],
    ("clip ratio", ("clip_ratio/region_mean",)),
)
DPI = 72

# Font-cache notices would land in the training log; they are not the user's business.
logging.getLogger("matplotlib").setLevel(logging.ERROR)


def _figure(n_panels: int, legend_rows: int = 0):
    """A grid of panels with fixed margins (a layout engine doubles the drawing time) and room
    under it for `legend_rows` rows of legend."""
    from matplotlib.figure import Figure

    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    legend = 0.22 * legend_rows + (0.1 if legend_rows else 0)  # inches
    height = 2.9 * rows + 0.4 + legend
    fig = Figure(figsize=(4.2 * cols, height), dpi=DPI)
    fig.subplots_adjust(
        left=0.22 / cols,
        right=0.98,
        top=1 - 0.65 / height,
        bottom=(0.45 + legend) / height,
        wspace=0.28,
        hspace=0.42,
    )
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes


def _keys(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for key in keys:
        if key.endswith("/*"):
            found += sorted({k for row in rows for k in row if k.startswith(key[:-1])} - set(found))
        elif key not in found:
            found.append(key)
    return [k for k in found if series(rows, k)[0]]


def _style(ax, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def _line(ax, steps: list[int], values: list[float], **kw) -> Any:
    # A metric logged at a few steps only (held-out accuracy) gets markers, so a point shows.
    style = {"marker": "o" if len(steps) <= 12 else None, "markersize": 3, "linewidth": 1.2, **kw}
    return ax.plot(steps, values, **style)[0]


def run_figure(rows: list[dict[str, Any]], title: str):
    """One panel per metric present: reward (and each reward's mean when there are several),
    held-out accuracy, kl, completion length, clip ratios, fraction of zero-std groups."""
    reward_parts = sorted(
        {k for row in rows for k in row if k.startswith("rewards/") and k.endswith("/mean")}
    )
    panels = [(t, _keys(rows, keys)) for t, keys in RUN_PANELS]
    panels = [(t, keys) for t, keys in panels if keys]
    fig, axes = _figure(len(panels))
    for ax, (panel_title, keys) in zip(axes, panels):
        for key in keys:
            label = key.split("/")[-1] if key.startswith(("clip_ratio/", "eval/accuracy/")) else key
            _line(ax, *series(rows, key), label=label)
        if keys == ["reward"] and len(reward_parts) > 1:
            for key in reward_parts:
                _line(
                    ax, *series(rows, key), label=key.split("/")[1], linewidth=0.8, alpha=0.6, linestyle="--"
                )
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
        _style(ax, panel_title)
    fig.suptitle(title, fontsize=10)
    return fig


def sweep_figure(runs: list[tuple[str, list[dict[str, Any]]]], title: str):
    """The runs' curves overlaid, one colour per run, with one legend of their labels."""
    present = [(t, keys) for t, keys in SWEEP_PANELS if any(_keys(rows, keys) for _, rows in runs)]
    ncol = min(len(runs), 3)
    fig, axes = _figure(len(present), legend_rows=math.ceil(len(runs) / ncol))
    colours = [f"C{i % 10}" for i in range(len(runs))] if len(runs) <= 10 else None
    handles = {}
    for ax, (panel_title, keys) in zip(axes, present):
        for i, (label, rows) in enumerate(runs):
            for key in _keys(rows, keys):
                colour = colours[i] if colours else _tab20(i, len(runs))
                handles.setdefault(label, _line(ax, *series(rows, key), color=colour))
        _style(ax, panel_title)
    fig.suptitle(title, fontsize=10)
    fig.legend(
        list(handles.values()),
        [_short(label) for label in handles],
        loc="lower center",
        ncol=ncol,
        fontsize=8,
        frameon=False,
    )
    return fig


def step_phases(
    rows: list[dict[str, Any]], events: list[dict[str, Any]]
) -> tuple[list[int], dict[str, list[float]]]:
    """The GRPO steps with a logged row (step > 0, with time/*) and each phase's seconds at them
    (PHASES order; a phase no step ran is left out; a checkpoint's seconds from its event)."""
    timed = [r for r in rows if r["step"] > 0 and any(k.startswith("time/") for k in r)]
    saved = {e["step"]: float(e.get("seconds", 0.0)) for e in events if e.get("kind") == "checkpoint"}
    steps = [r["step"] for r in timed]
    phases = {}
    for name in PHASES:
        values = [
            saved.get(r["step"], 0.0) if name == "checkpoint" else float(r.get(f"time/{name}", 0.0))
            for r in timed
        ]
        if any(values):
            phases[name] = values
    return steps, phases


def step_marks(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The steps to mark, by MARKERS kind: from the events, and the all-zero-std steps from the rows."""
    marks = {kind: sorted({e["step"] for e in events if e.get("kind") == kind}) for kind in MARKERS}
    marks["zero_std"] = sorted(
        {r["step"] for r in rows if r["step"] > 0 and r.get("frac_reward_zero_std") == 1.0}
        | set(marks["zero_std"])
    )
    return {kind: steps for kind, steps in marks.items() if steps}


def timeline_figure(rows: list[dict[str, Any]], events: list[dict[str, Any]], title: str):
    """Each step's seconds by phase, stacked, with the steps' events marked above the bars."""
    from matplotlib.figure import Figure

    steps, phases = step_phases(rows, events)
    marks = step_marks(rows, events)
    fig = Figure(figsize=(max(6.0, min(16.0, 0.12 * len(steps) + 4)), 3.6), dpi=DPI)
    fig.subplots_adjust(left=0.08, right=0.78, top=0.88, bottom=0.14)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(steps)
    for name, values in phases.items():
        ax.bar(steps, values, bottom=bottom, width=0.85, label=name, color=f"C{PHASES.index(name)}")
        bottom = [b + v for b, v in zip(bottom, values)]
    top = max(bottom, default=0.0) or 1.0
    for j, (kind, at) in enumerate(marks.items()):
        marker, colour, label = MARKERS[kind]
        ax.scatter(
            at, [top * (1.04 + 0.06 * j)] * len(at), marker=marker, color=colour, s=22, label=label, zorder=3
        )
    _style(ax, "seconds a step, by phase")
    ax.set_ylabel("seconds", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def sweep_timeline_figure(runs: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]], title: str):
    """A sweep's runs side by side: each run's mean seconds a step by phase, stacked, and the count
    of its marked steps by kind under its bar."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.1 * len(runs) + 4), 4.2), dpi=DPI)
    fig.subplots_adjust(left=0.08, right=0.78, top=0.88, bottom=0.3)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(runs)
    means = [step_phases(rows, events) for _, rows, events in runs]
    for name in PHASES:
        values = [sum(ph.get(name, [])) / max(len(steps), 1) for steps, ph in means]
        if any(values):
            ax.bar(
                range(len(runs)), values, bottom=bottom, width=0.7, label=name, color=f"C{PHASES.index(name)}"
            )
            bottom = [b + v for b, v in zip(bottom, values)]
    labels = []
    for label, rows, events in runs:
        counts = ", ".join(f"{len(at)} {kind}" for kind, at in step_marks(rows, events).items())
        labels.append(_short(label, 40) + (f"\n({counts})" if counts else ""))
    ax.set_xticks(range(len(runs)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_title("mean seconds a step, by phase", fontsize=10)
    ax.set_ylabel("seconds", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def _tab20(i: int, n: int):
    from matplotlib import colormaps

    return colormaps["tab20"](i % 20)


def _short(label: str, limit: int = 70) -> str:
    return label if len(label) <= limit else label[: limit - 3] + "..."


def save_png(fig, path: Path) -> Path:
    """Write the figure whole under a temporary name, then rename it into place."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    write_atomic(Path(path), buffer.getvalue())
    return Path(path)


def draw_run(run_dir: Path, title: str | None = None) -> Path | None:
    """`metrics.png` in the run folder; None when it has no metrics yet."""
    rows = read_metrics(run_dir)
    if not any(len(row) > 1 for row in rows):
        return None
    path = save_png(run_figure(rows, title or str(run_dir)), Path(run_dir) / RUN_PLOT)
    events = read_events(run_dir)
    if step_phases(rows, events)[0]:  # (timeline.png beside it, once a step has its times)
        save_png(timeline_figure(rows, events, title or str(run_dir)), Path(run_dir) / TIMELINE_PLOT)
    return path


def draw_sweep(folder: Path, runs: list[tuple[str, Path]], title: str | None = None) -> Path | None:
    """`summary.png` in `folder`: the given (label, run folder) pairs overlaid; None when no run
    has metrics yet."""
    data = [(label, read_metrics(run_dir)) for label, run_dir in runs]
    data = [(label, rows) for label, rows in data if any(len(row) > 1 for row in rows)]
    if not data:
        return None
    path = save_png(sweep_figure(data, title or str(folder)), Path(folder) / SWEEP_PLOT)
    timed = [(label, read_metrics(run_dir), read_events(run_dir)) for label, run_dir in runs]
    timed = [run for run in timed if step_phases(run[1], run[2])[0]]
    if timed:
        save_png(sweep_timeline_figure(timed, title or str(folder)), Path(folder) / TIMELINE_PLOT)
    return path


def draw_safely(draw: Callable[..., Path | None], *args: Any, prog: str, **kwargs: Any) -> Path | None:
    """Run a draw_* function; on any failure print one warning line and return None."""
    try:
        return draw(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a plot must never hide the training result or error
        where = args[0] if args else ""
        print(
            f"{prog}: warning: could not draw the plots in {where}: {first_line(exc, 200)}",
            file=sys.stderr,
            flush=True,
        )
        return None
