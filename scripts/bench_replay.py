#!/usr/bin/env python
"""Saved rollouts and replay (issue #63): a run's time against its replay's, and the saved
rollouts' size on disk per 1,000 completions.

    bash scripts/run.sh python scripts/bench_replay.py --steps 8

One grpo-train run of the default recipe (its model, data, rewards; --steps steps, fp32 unless
--precision says otherwise) with trainer.save_rollouts=true, then its replay (the same command
plus trainer.replay), each a fresh process on every core, one after the other. Per arm: wall
time, the summed step_time and the phase times (rollout, reward, reference, policy); whether the
replay's last weights equal the original's bit for bit (it says so itself); the rollouts' bytes,
per step and per 1,000 completions. Prints a table and writes scripts/results/replay.json
(harness.write_result; --json elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import harness

PHASES = ("rollout", "reward", "reference", "policy")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--json", type=Path, help="write the result here (default scripts/results/replay.json)")
    p.add_argument("extra", nargs="*", help="more grpo-train overrides, for both runs")
    args = p.parse_args(argv)
    threads = os.cpu_count() or 1
    common = [
        f"trainer.max_steps={args.steps}",
        f"trainer.save_steps={args.steps}",
        f"trainer.precision={args.precision}",
        "trainer.eval_before=false",
        "data.eval_size=8",
        *args.extra,
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        original, again = Path(tmp) / "original", Path(tmp) / "replay"
        arms = {
            "original": (common + ["trainer.save_rollouts=true"], original),
            "replay": (common + [f"trainer.replay={original}"], again),
        }
        for arm, (overrides, run_dir) in arms.items():
            done = harness.train(overrides, run_dir, threads=threads)
            steps = harness.step_rows(run_dir)
            row = {
                "arm": arm,
                "steps": len(steps),
                "wall_s": round(done.wall_s, 2),
                "step_time_s": round(sum(r["step_time"] for r in steps), 2),
                **{f"{ph}_s": round(sum(r.get(f"time/{ph}", 0.0) for r in steps), 2) for ph in PHASES},
            }
            if arm == "replay":
                said = " ".join(done.stdout.split())
                row["bit_for_bit"] = "weights equal the original's" in said
            rows.append(row)
        index = json.loads((original / "rollouts" / "index.json").read_text())
        entries = [e for e in index["steps"].values() if e["file"]]
        size = sum(e["bytes"] for e in entries)
        completions = sum(e["rows"] for e in entries)
    per_1000 = size / completions * 1000
    replay_over_original = rows[1]["step_time_s"] / rows[0]["step_time_s"]
    rows[0] |= {
        "rollout_bytes": size,
        "completions_saved": completions,
        "bytes_per_1000_completions": round(per_1000),
    }
    harness.print_table(rows, list(rows[0]) + ["bit_for_bit"])
    notes = (
        f"replay / original step time {replay_over_original:.3f}; saved rollouts {per_1000 / 1e6:.2f} MB per 1,000 "
        f"completions; {args.steps} steps, {args.precision}, {threads} threads"
    )
    print(notes)
    print(f"wrote {harness.write_result('replay', rows, notes=notes, path=args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
