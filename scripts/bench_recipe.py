#!/usr/bin/env python
"""How well does a training recipe learn? Held-out accuracy over steps, per configuration and seed.

    bash scripts/run.sh python scripts/bench_recipe.py --out sweep/ \
        --config default= --config cosine="optimizer.lr_scheduler=cosine" --seeds 0 1 2
    bash scripts/run.sh python scripts/bench_recipe.py --out sweep/ --report-only

Each (configuration, seed) is one `grpo-train` run in OUT/<name>-s<seed>/ with the configuration's
overrides plus trainer.seed=<seed>, trainer.eval_steps (default 8: held-out greedy accuracy every
8 steps, on both held-out sets) and trainer.max_steps (default 64). A run whose metrics.jsonl
already reaches its last step is not run again, so the command can be repeated to add seeds or
configurations. --jobs N runs N at once, each on cpu_count/N threads (accuracy does not depend on
the thread count's timing; the curves are what is measured here, not speed).

The report (printed, and written as OUT/recipe.json and OUT/recipe.png): per configuration, the
held-out accuracy (mean and range over seeds) at the evaluation whose cumulative sampled
completions (num_completions_sampled, so adaptive rounds and dynamic sampling's discarded groups
count) stay within each budget in --budgets (default 256, 512, 1024, 2048: steps 8/16/32/64 of the default 4 x 8);
the wide held-out set (operands outside the training range) and per-operation accuracy at the
last budget; and a plot of mean accuracy against sampled completions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness

OPERATIONS = ("plus", "minus", "minus_negative", "times")  # data.eval_group_by=kind


def parse_config(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name or "/" in name:
        raise SystemExit(
            f"--config {text!r}: give NAME=OVERRIDES (space-separated), e.g. cosine='optimizer.lr_scheduler=cosine'"
        )
    return name, overrides.split()


def finished(run: Path, steps: int) -> bool:
    rows = harness.rows(run)
    return bool(rows) and (rows[-1].get("step") == steps or (run / "STOPPED_AT_BUDGET").exists())


def completions(row: dict, group_size: int) -> int:
    """A step's sampled completions (adaptive rounds and discarded groups count)."""
    return row.get("num_completions_sampled", row.get("num_groups_sampled", 0) * group_size)


def train(run: Path, overrides: list[str], seed: int, args, threads: int) -> float:
    """One grpo-train run; stopped (SIGTERM: it saves and exits) at the first evaluation whose
    cumulative sampled completions reach the last budget."""
    overrides = [
        *overrides,
        f"trainer.seed={seed}",
        f"trainer.max_steps={args.steps}",
        f"trainer.eval_steps={args.eval_steps}",
        f"trainer.save_steps={args.save_steps or args.steps}",
        "trainer.keep_last=2",
    ]

    def past_budget() -> bool:
        if not _past_budget(run, args.budgets[-1]):
            return False
        (run / "STOPPED_AT_BUDGET").write_text("")
        return True

    log_path = run.parent / f"{run.name}.log"
    done = harness.train(overrides, run, threads=threads, log=log_path, stop=past_budget, check=False)
    if done.returncode not in (0, 143):
        print(f"{run.name}: grpo-train exited {done.returncode}; see {log_path}", file=sys.stderr)
    return done.wall_s


def _past_budget(run: Path, budget: int) -> bool:
    rows = harness.rows(run)
    if not rows or not (run / "config.yaml").exists():
        return False
    g, used = group_size(run), 0
    for row in rows[1:]:
        used += completions(row, g)
        if "eval/accuracy" in row and used >= budget:
            return True
    return False


def budget_rows(rows: list[dict], group_size: int, budgets: list[int]) -> dict[int, dict]:
    """For each budget, the last evaluated row whose cumulative sampled completions stay within it."""
    out, used = {}, 0
    evaluated = [(0, rows[0])] if rows and "eval/accuracy" in rows[0] else []
    for row in rows[1:]:
        used += completions(row, group_size)
        if "eval/accuracy" in row:
            evaluated.append((used, row))
    for budget in budgets:
        within = [(u, r) for u, r in evaluated if u <= budget]
        if within and within[-1][0] >= budget * 0.75:  # near the budget, not far short of it
            out[budget] = {"completions": within[-1][0], **within[-1][1]}
    return out


def group_size(run: Path) -> int:
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    return int(cfg["sampler"]["num_generations"])


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    return f"{mean:.3f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{mean:.3f}"


def report(configs: list[tuple[str, list[str]]], seeds: list[int], args) -> dict:
    result = {"budgets": args.budgets, "configs": []}
    for name, overrides in configs:
        per_seed = {}
        for seed in seeds:
            run = args.out / f"{name}-s{seed}"
            rows = harness.rows(run)
            if rows and (run / "config.yaml").exists():
                per_seed[seed] = {"rows": rows, "at": budget_rows(rows, group_size(run), args.budgets)}
        if not per_seed:
            continue
        entry = {"name": name, "overrides": overrides, "seeds": sorted(per_seed), "at_budget": {}}
        for budget in args.budgets:
            got = [s["at"][budget] for s in per_seed.values() if budget in s["at"]]
            entry["at_budget"][budget] = {
                "steps": [r["step"] for r in got],
                "accuracy": [r["eval/accuracy"] for r in got],
                "wide_accuracy": [r["eval_wide/accuracy"] for r in got if "eval_wide/accuracy" in r],
                **{
                    op: [r[f"eval/accuracy/{op}"] for r in got if f"eval/accuracy/{op}" in r]
                    for op in OPERATIONS
                },
            }
        entry["before"] = [s["rows"][0].get("eval/accuracy") for s in per_seed.values()]
        entry["curves"] = {
            seed: [(0, s["rows"][0].get("eval/accuracy"))]
            + [
                (u, r["eval/accuracy"])
                for u, r in _evaluated(s["rows"], group_size(args.out / f"{name}-s{seed}"))
            ]
            for seed, s in per_seed.items()
        }
        result["configs"].append(entry)
    return result


def _evaluated(rows, g):
    used = 0
    for row in rows[1:]:
        used += completions(row, g)
        if "eval/accuracy" in row:
            yield used, row


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    last = result["budgets"][-1]
    table = Table(
        title="held-out greedy accuracy: mean (range) over seeds, at sampled completions", header_style="bold"
    )
    table.add_column("configuration")
    table.add_column("seeds", justify="right")
    for budget in result["budgets"]:
        table.add_column(str(budget), justify="right")
    table.add_column(f"wide @{last}", justify="right")
    for op in OPERATIONS:
        table.add_column(f"{op} @{last}", justify="right")
    for entry in result["configs"]:
        at = entry["at_budget"]
        table.add_row(
            entry["name"],
            str(len(entry["seeds"])),
            *[spread(at[b]["accuracy"]) for b in result["budgets"]],
            spread(at[last]["wide_accuracy"]),
            *[spread(at[last][op]) for op in OPERATIONS],
        )
    Console(width=200).print(table)


GOAL = 0.70  # issue #31's 3-seed mean within 2,048 completions


def _interpolate(curve: list[tuple[float, float]], u: float) -> float:
    for (u0, a0), (u1, a1) in zip(curve, curve[1:]):
        if u0 <= u <= u1:
            return a0 if u1 == u0 else a0 + (a1 - a0) * (u - u0) / (u1 - u0)
    return curve[-1][1]


def plot(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=90)
    ax = fig.subplots()
    for i, entry in enumerate(result["configs"]):
        curves = [[(u, a) for u, a in curve if a is not None] for curve in entry["curves"].values()]
        # Seeds evaluate at other completion counts (adaptive rounds, dynamic sampling): each
        # curve is interpolated linearly onto a common grid, up to where the shortest one ends.
        end = min(curve[-1][0] for curve in curves)
        xs = [u for u in range(0, int(end) + 1, 64)]
        at = [[_interpolate(curve, u) for curve in curves] for u in xs]
        mean = [statistics.fmean(v) for v in at]
        low, high = [min(v) for v in at], [max(v) for v in at]
        ax.plot(xs, mean, color=f"C{i}", label=f"{entry['name']} ({len(curves)} seeds)")
        if len(curves) > 1:
            ax.fill_between(xs, low, high, color=f"C{i}", alpha=0.12)
    ax.axhline(GOAL, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("sampled completions")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("held-out accuracy (mean over seeds, band: range)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder of the runs and the report")
    p.add_argument(
        "--config", action="append", default=[], help="NAME=OVERRIDES (space-separated); repeatable"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--eval-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps too (0: at the end)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--report-only", action="store_true", help="only read the runs in OUT")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    configs = [parse_config(c) for c in args.config]
    if args.report_only and not configs:  # every run folder in OUT, by name
        names = sorted(
            {d.name.rsplit("-s", 1)[0] for d in args.out.iterdir() if d.is_dir() and "-s" in d.name}
        )
        configs = [(n, []) for n in names]
    if not args.report_only:
        todo = [
            (args.out / f"{name}-s{seed}", overrides, seed)
            for seed in args.seeds
            for name, overrides in configs
            if not finished(args.out / f"{name}-s{seed}", args.steps)
        ]
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        with ThreadPoolExecutor(args.jobs) as pool:
            for (run, _, _), seconds in zip(todo, pool.map(lambda job: train(*job, args, threads), todo)):
                print(f"{run.name}: {seconds / 60:.1f} min", flush=True)
    result = report(configs, args.seeds, args)
    print_table(result)
    harness.write_json(args.out / "recipe.json", result, indent=1)
    plot(result, args.out / "recipe.png")
    print(f"wrote {args.out / 'recipe.json'} and {args.out / 'recipe.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
