#!/usr/bin/env python
"""What skipping zero-std groups saves, late in a default-recipe run: step time with and without.

    bash scripts/run.sh python scripts/bench_skip.py --run sweep/default-s0 --from-step 40 --to-step 64

--run is a grpo-train run folder with a checkpoint at --from-step (scripts/bench_recipe.py
--save-steps 40 leaves one). Each arm resumes that checkpoint into a fresh folder and trains to
--to-step, with trainer.skip_zero_std=true (the default: zero-std groups leave the policy
forward/backward and the reference pass) or false (every row runs, at weight 0 where zero-std);
the arms alternate, --rounds times, each a fresh process on every core, one at a time. The same
checkpoint, seeds and data: the arms sample the same prompts, and the same completions until
their weights part in the last bits (the skip's smaller batch rounds differently).

Per arm: median step_time and time/policy over the resumed steps, the zero-std share, the rows
trained per step, and skip/no-skip ratios. Prints a table and writes the result, one row per arm
(harness.write_result: scripts/results/skip.json; --json elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import yaml

ARMS = {"skip": "true", "no skip": "false"}


def resume(run: Path, checkpoint: Path, out: Path, to_step: int, skip: str, threads: int) -> list[dict]:
    overrides = yaml.safe_load((run / "overrides.yaml").read_text()) or []
    keep = [
        o
        for o in overrides
        if not o.split("=")[0].lstrip("+").startswith(("hydra.", "trainer.max_steps", "trainer.eval_steps"))
        and not o.split("=")[0].startswith(("trainer.save_steps", "trainer.keep_last", "trainer.resume"))
    ]
    overrides = [
        *keep,
        f"trainer.max_steps={to_step}", "trainer.eval_steps=0", f"trainer.save_steps={to_step}",
        f"trainer.skip_zero_std={skip}", f"trainer.resume={checkpoint}",
    ]  # fmt: skip
    rows = harness.launch(overrides, out, threads=threads)
    return [r for r in rows if "step_time" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--from-step", type=int, default=40)
    p.add_argument("--to-step", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the result here (default scripts/results/skip.json)")
    args = p.parse_args(argv)
    checkpoint = args.run.resolve() / "checkpoints" / f"step-{args.from_step:06d}"
    if not checkpoint.is_dir():
        raise SystemExit(f"{checkpoint} does not exist: give a run with a checkpoint at --from-step")
    threads = os.cpu_count() or 1
    steps: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r, arm in harness.interleave(list(ARMS), args.rounds):
            t0 = time.perf_counter()
            got = resume(args.run, checkpoint, Path(tmp) / f"{r}-{arm}", args.to_step, ARMS[arm], threads)
            steps[arm] += got
            print(f"round {r} {arm}: {len(got)} steps, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [
        {
            "arm": arm,
            "step_range": [args.from_step + 1, args.to_step],
            "rounds": args.rounds,
            "step_time_median": statistics.median(r["step_time"] for r in got),
            "policy_median": statistics.median(r["time/policy"] for r in got),
            "frac_reward_zero_std": statistics.fmean(r["frac_reward_zero_std"] for r in got),
            "rows_trained_mean": statistics.fmean(r["num_rows_trained"] for r in got),
            "steps": len(got),
        }
        for arm, got in steps.items()
    ]
    skip, full = rows
    ratio_step_time = skip["step_time_median"] / full["step_time_median"]
    ratio_policy = skip["policy_median"] / full["policy_median"]
    print(f"\nsteps {args.from_step + 1}-{args.to_step}, {threads} threads, {args.rounds} round(s)")
    print(f"{'arm':8s} {'step_time':>10s} {'time/policy':>12s} {'zero-std':>9s} {'rows trained':>13s}")
    for a in rows:
        print(
            f"{a['arm']:8s} {a['step_time_median']:9.2f}s {a['policy_median']:11.2f}s "
            f"{a['frac_reward_zero_std']:9.0%} {a['rows_trained_mean']:13.1f}"
        )
    print(f"skip / no skip: step time {ratio_step_time:.2f}, policy {ratio_policy:.2f}")
    notes = f"skip / no skip: step time {ratio_step_time:.3f}, policy {ratio_policy:.3f}; {threads} threads"
    print(f"wrote {harness.write_result('skip', rows, notes=notes, path=args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
