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
trained per step, and skip/no-skip ratios. Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"skip": "true", "no skip": "false"}


def resume(run: Path, checkpoint: Path, out: Path, to_step: int, skip: str, threads: int) -> list[dict]:
    overrides = yaml.safe_load((run / "overrides.yaml").read_text()) or []
    keep = [
        o
        for o in overrides
        if not o.split("=")[0].lstrip("+").startswith(("hydra.", "trainer.max_steps", "trainer.eval_steps"))
        and not o.split("=")[0].startswith(("trainer.save_steps", "trainer.keep_last", "trainer.resume"))
    ]
    cmd = [
        sys.executable, "-m", "grpo_cli.cli.train", *keep,
        f"trainer.max_steps={to_step}", "trainer.eval_steps=0", f"trainer.save_steps={to_step}",
        f"trainer.skip_zero_std={skip}", f"trainer.resume={checkpoint}", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"grpo-train exited {res.returncode}:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--from-step", type=int, default=40)
    p.add_argument("--to-step", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "bench_skip.json")
    args = p.parse_args(argv)
    checkpoint = args.run.resolve() / "checkpoints" / f"step-{args.from_step:06d}"
    if not checkpoint.is_dir():
        raise SystemExit(f"{checkpoint} does not exist: give a run with a checkpoint at --from-step")
    threads = os.cpu_count() or 1
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for arm in list(ARMS)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                got = resume(args.run, checkpoint, Path(tmp) / f"{r}-{arm}", args.to_step, ARMS[arm], threads)
                rows[arm] += got
                print(f"round {r} {arm}: {len(got)} steps, {time.perf_counter() - t0:.0f} s", flush=True)
    result = {
        "machine": platform.processor() or platform.machine(),
        "threads": threads,
        "steps": [args.from_step + 1, args.to_step],
        "rounds": args.rounds,
        "arms": {},
    }
    for arm, got in rows.items():
        result["arms"][arm] = {
            "step_time_median": statistics.median(r["step_time"] for r in got),
            "policy_median": statistics.median(r["time/policy"] for r in got),
            "frac_reward_zero_std": statistics.fmean(r["frac_reward_zero_std"] for r in got),
            "rows_trained_mean": statistics.fmean(r["num_rows_trained"] for r in got),
            "steps": len(got),
        }
    skip, full = result["arms"]["skip"], result["arms"]["no skip"]
    result["ratio_step_time"] = skip["step_time_median"] / full["step_time_median"]
    result["ratio_policy"] = skip["policy_median"] / full["policy_median"]
    print(f"\nsteps {args.from_step + 1}-{args.to_step}, {threads} threads, {args.rounds} round(s)")
    print(f"{'arm':8s} {'step_time':>10s} {'time/policy':>12s} {'zero-std':>9s} {'rows trained':>13s}")
    for arm, a in result["arms"].items():
        print(
            f"{arm:8s} {a['step_time_median']:9.2f}s {a['policy_median']:11.2f}s "
            f"{a['frac_reward_zero_std']:9.0%} {a['rows_trained_mean']:13.1f}"
        )
    print(f"skip / no skip: step time {result['ratio_step_time']:.2f}, policy {result['ratio_policy']:.2f}")
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
