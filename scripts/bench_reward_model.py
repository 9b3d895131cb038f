#!/usr/bin/env python
"""What a reward model costs on the default recipe: the rewards' time per step and the run's peak
memory, with and without a reward model, side by side.

    .venv/bin/python scripts/bench_reward_model.py --reward-model DIR    # writes scripts/results/reward_model.json

Each arm is a fresh grpo-train process (the default recipe: SmolLM2-135M-Instruct, 4 prompts x 8
completions per step, reward=[accuracy,format]) of --steps steps, the arms alternating, --repeats
times each. The "model" arm adds reward=model with DIR (e.g. one made by
grpo_cli.rewards.model.from_causal_lm from SmolLM2 itself: a 135M-parameter sequence classifier) at
weight 0, so both arms sample and train the same completions and differ only in the scoring. Per
arm: the median over steps of time/reward (the step's scoring) and of time/rewards/<name>, the
median step time, and the process's peak resident memory (getrusage's ru_maxrss). Prints a table
and writes the result, one row per run (harness.write_result; --out elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import harness

ARMS = ("plain", "model")


def run(arm: str, args, folder: Path) -> dict:
    overrides = [
        f"trainer.max_steps={args.steps}",
        "trainer.eval_before=false",
        "data.eval_size=0",
        "trainer.save_steps=1000",
        "trainer.quiet=true",
    ]
    if arm == "model":
        overrides += [
            "reward=[accuracy,format,model]",
            f"reward.model.name_or_path={args.reward_model}",
            "reward.model.weight=0.0",
        ]
    done = harness.train(overrides, folder, name=arm, cwd=Path.cwd())  # (where a relative DIR is)
    peak = done.peak_rss_kib * 1024  # (ru_maxrss: KiB)
    rows = [r for r in harness.rows(folder) if "reward" in r]
    out = {
        "peak_rss_bytes": peak,
        "step_time_s": statistics.median(r["step_time"] for r in rows),
        "reward_time_s": statistics.median(r["time/reward"] for r in rows),
        "steps": len(rows),
    }
    for key in sorted({k for r in rows for k in r if k.startswith("time/rewards/")}):
        out[key] = statistics.median(r[key] for r in rows)
    if arm == "model":
        out["model_score_mean"] = statistics.fmean(r["rewards/model/mean"] for r in rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reward-model", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--out", type=Path, help="write the result here (default scripts/results/reward_model.json)"
    )
    args = p.parse_args()
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for arm in ARMS:
                results[arm].append(run(arm, args, Path(tmp) / f"{arm}-{repeat}"))
                print(arm, repeat, results[arm][-1], flush=True)

    def med(arm, key):
        return statistics.median(r[key] for r in results[arm])

    print(f"\ndefault recipe, {args.steps} steps per run, {args.repeats} runs per arm (medians)")
    print(f"{'arm':<6} {'step s':>7} {'reward s':>9} {'model s':>8} {'peak RSS MiB':>13}")
    for arm in ARMS:
        model_s = med(arm, "time/rewards/model") if arm == "model" else float("nan")
        print(
            f"{arm:<6} {med(arm, 'step_time_s'):>7.2f} {med(arm, 'reward_time_s'):>9.3f} {model_s:>8.3f} "
            f"{med(arm, 'peak_rss_bytes') / 2**20:>13.0f}"
        )
    ratio = med("model", "peak_rss_bytes") / med("plain", "peak_rss_bytes")
    print(f"peak memory with the reward model / without: {ratio:.2f}")
    rows = [{"arm": arm, "repeat": i, **r} for arm in ARMS for i, r in enumerate(results[arm])]
    notes = f"the reward model: {args.reward_model}; peak memory with it / without: {ratio:.3f}"
    print(f"wrote {harness.write_result('reward_model', rows, notes=notes, path=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
