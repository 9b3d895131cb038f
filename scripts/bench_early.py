#!/usr/bin/env python
"""Early stopping on the default recipe (issue #63): how many steps it saves and what held-out
accuracy it keeps, beside the seed spread (0.58-0.65 over 6 runs on two machine kinds).

    bash scripts/run.sh python scripts/bench_early.py                 # runs the recipe, then reads it
    bash scripts/run.sh python scripts/bench_early.py --run DIR       # reads a run made so already

The run is the default recipe with a validation set (data.val_size=100: the built-in arithmetic
draws it apart, so the training rows and the trajectory are the recipe's own) evaluated every
trainer.eval_steps=8 steps, greedy, to the end (no early stopping). Evaluation draws from no
training generator, so a run with early stopping is this run cut at the step the rule stops
(tested bit for bit, tests/test_early.py); the rule (grpo_cli.early.decide) is applied to the
run's evaluations for each patience and target. Per rule: the step it stops at, the steps saved,
the best step it keeps (checkpoints/best) with the held-out accuracy there, and the held-out
accuracy at the end of the whole run. Prints a table and writes scripts/results/early.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import harness

RULES = [("patience", 1), ("patience", 2), ("patience", 3), ("target", 0.6), ("target", 0.65)]


def rules_on(evals: list[dict], total: int) -> list[dict]:
    from grpo_cli.early import Progress, decide

    out = []
    for kind, value in RULES:
        progress, stop_at = Progress(), total
        for row in evals:
            d = decide(
                progress,
                row.get("val/accuracy"),
                row["step"],
                patience=value if kind == "patience" else None,
                target=value if kind == "target" else None,
                held_out=row.get("eval/accuracy"),
            )
            progress = d.progress
            if d.stop:
                stop_at = row["step"]
                break
        at_stop = next(r["eval/accuracy"] for r in evals if r["step"] == stop_at)
        out.append(
            {
                "rule": f"{kind} {value}",
                "stops_at": stop_at,
                "steps_saved": total - stop_at,
                "best_step": progress.best_step,
                "val_best": round(progress.best, 3),
                "held_out_at_best": progress.best_held_out,
                "held_out_at_stop": at_stop,
                "held_out_full_run": evals[-1]["eval/accuracy"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run", type=Path, help="a run folder made with the overrides below (default: run one now)"
    )
    p.add_argument("--json", type=Path, help="write the result here (default scripts/results/early.json)")
    p.add_argument("extra", nargs="*", help="more grpo-train overrides")
    args = p.parse_args(argv)
    overrides = ["data.val_size=100", "trainer.eval_steps=8", *args.extra]
    with tempfile.TemporaryDirectory(prefix="bench-early-") as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            harness.train(overrides, run, threads=os.cpu_count() or 1)
        rows = harness.rows(run)
    evals = [r for r in rows if r.get("step", 0) > 0 and "val/accuracy" in r]
    total = max(r["step"] for r in rows)
    if not evals or evals[-1]["step"] != total:
        raise SystemExit(f"{run}: no evaluation at its last step {total}; give a finished run")
    result = rules_on(evals, total)
    harness.print_table(result, list(result[0]))
    curve = ", ".join(f"{r['step']}: {r['val/accuracy']:.3f}/{r['eval/accuracy']:.3f}" for r in evals)
    notes = f"validation/held-out accuracy by step: {curve}; overrides {' '.join(overrides)}"
    print(notes)
    print(f"wrote {harness.write_result('early', result, notes=notes, path=args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
