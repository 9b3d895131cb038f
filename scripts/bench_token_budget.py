#!/usr/bin/env python
"""Micro-batches by a token budget against today's equal split (issue #50): the policy (and
reference) phase's time and peak memory per step.

    bash scripts/run.sh python scripts/bench_token_budget.py                 # every case
    bash scripts/run.sh python scripts/bench_token_budget.py long --pairs 2  # one case

Cases (the default model, SmolLM2-135M-Instruct, and task; fp32, 2 cores):
- default: the default recipe (4 prompts x 8, 16 new tokens).
- calculator: environment=calculator (multi-turn episodes with tool replies).
- long: sampler.max_new_tokens=256 (EOS honoured: lengths vary).
Each arm is a fresh `grpo-train` process of --steps steps (no held-out evaluation), the arms
alternating (harness.interleave), --pairs times: "today" (trainer.micro_batch_tokens=null, one
micro-batch of the step's 32 rows) and "budget" (trainer.micro_batch_tokens=--budget). Both start
from the same weights and seed, at a learning rate of 1e-30 (COMMON: the weights stay as they
are), so both sample the same completions every step and time the same batches.

Per step it reads time/policy and time/reference from metrics.jsonl; the child process also
records each phase's peak memory: /proc/self/clear_refs resets the resident-set high-water mark
(VmHWM) to the current RSS before the phase, and the mark is read after it: the process's peak
during the phase (the weights, Adam's state and what the allocator kept are in both arms alike). Per arm: the
medians over the steps after the first (its self-check scores every row); per case: budget/today
ratios per pair and their median. Prints a table and writes scripts/results/token_budget.json.
A benchmark: nothing is asserted.

    ... bench_token_budget.py --fits 16       # runs nothing
    ... bench_token_budget.py --fits 16 --confirm   # and one run of the budget's longest

--fits GIB: the longest completion (4 prompts x 8 a step, the Qwen2.5-0.5B shape, fp32, full
fine-tuning, beta 0.04) whose memory estimate (grpo-check-env's) is within GIB GiB, today (the
step's 4 groups in one micro-batch) and with trainer.micro_batch_tokens=--budget (the largest
micro-batch the budget allows: one group when a group alone is over it). Bisected on the
estimate; writes scripts/results/token_budget_fits.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import harness

OUT = harness.ROOT / ".bench" / "token_budget"
CASES = {
    "default": [],
    "calculator": ["environment=calculator"],
    "long": ["sampler.max_new_tokens=256"],
}
# optimizer.learning_rate=1e-30 (0 is refused): a step of ~1e-30 is below a weight's last bit, so
# the weights never move and both arms sample the same completions every step (with learning,
# another split's last-bit rounding soon draws other episodes, and the phases would time other
# batches); the forward, backward and optimizer step all still run.
COMMON = [
    "data.eval_size=0",
    "trainer.eval_before=false",
    "trainer.save_steps=1000",
    "trainer.quiet=true",
    "optimizer.learning_rate=1e-30",
]


def child(argv: list[str]) -> None:
    """grpo-train in this process (argv: its arguments, hydra.run.dir last), with the learner's
    reference and update phases wrapped to record the process's peak resident set during each
    (KiB), one JSON line per phase in the run folder's phase_memory.jsonl."""
    from grpo_cli import roles
    from grpo_cli.cli import train

    run_dir = Path(argv[-1].split("=", 1)[1])
    log = open(run_dir / "phase_memory.jsonl", "a")

    def measured(name, fn):
        def wrapper(self, *args, **kwargs):
            harness.reset_peak()  # VmHWM := VmRSS
            out = fn(self, *args, **kwargs)
            log.write(json.dumps({"phase": name, "peak_kib": harness.status_kib("VmHWM")}) + "\n")
            log.flush()
            return out

        return wrapper

    roles.Learner.update = measured("policy", roles.Learner.update)
    roles.Learner.reference = measured("reference", roles.Learner.reference)
    sys.argv = ["grpo-train", *argv]
    train.main()


def run_arm(case: str, arm: str, pair: int, a) -> dict:
    run_dir = OUT / f"{case}-{arm}-{pair}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    budget = "null" if arm == "today" else str(a.budget)
    overrides = [
        *CASES[case],
        *COMMON,
        f"trainer.max_steps={a.steps}",
        f"trainer.micro_batch_tokens={budget}",
    ]
    harness.train(overrides, run_dir, entry=harness.script(__file__, "--child"), name=f"{case}/{arm}")
    steps = harness.step_rows(run_dir)[1:]  # (step 1: the self-check scores every row)
    phases = [json.loads(line) for line in (run_dir / "phase_memory.jsonl").read_text().splitlines()]
    policy_mem = [p["peak_kib"] for p in phases if p["phase"] == "policy"][1:]
    return {
        "case": case,
        "arm": arm,
        "pair": pair,
        "steps": len(steps),
        "policy_s": harness.median(r["time/policy"] for r in steps),
        "reference_s": harness.median(r.get("time/reference", 0.0) for r in steps),
        "phase_s": harness.median(r["time/policy"] + r.get("time/reference", 0.0) for r in steps),
        "policy_peak_mib": harness.median(policy_mem) / 1024,
        "policy_peak_max_mib": max(policy_mem) / 1024,
        "step_s": harness.median(r["step_time"] for r in steps),
        "completion_mean": harness.median(r["completions/mean_length"] for r in steps),
        "completion_max": harness.median(r["completions/max_length"] for r in steps),
    }


def fits(gib: float, budget: int) -> list[dict]:
    """The longest completion within `gib` GiB by the estimate, without and with the budget."""
    from bench_memory_estimate import estimate
    from bench_qwen_shape import shape_folder

    folder = shape_folder(harness.ROOT / ".bench", "qwen0.5b", weights=False)
    rows = []
    for arm, split in (
        ("today", "trainer.gradient_accumulation_steps=1"),
        ("budget", f"trainer.micro_batch_tokens={budget}"),
    ):

        def total(length: int, split: str = split) -> dict:
            extra = [
                "trainer.prompts_per_step=4",
                "sampler.num_generations=8",
                f"sampler.max_new_tokens={length}",
                "trainer.precision=fp32",
                split,
            ]
            return estimate(folder, extra, "full")

        lo, hi = 0, 1 << 16  # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if total(mid)["total"] <= gib * 2**30 else (lo, mid)
        est = total(lo)
        rows.append(
            {
                "arm": arm,
                "budget_gib": gib,
                "largest_completion_tokens": lo,
                "estimate_gib": est["total"] / 2**30,
                "activations_gib": est["activations"] / 2**30,
            }
        )
    harness.print_table(rows, list(rows[0]))
    notes = f"--fits {gib:g} --budget {budget}: estimates only, nothing run"
    print(f"wrote {harness.write_result('token_budget_fits', rows, notes=notes)}")
    return rows


def confirm(rows: list[dict], budget: int) -> None:
    """One real run of the budget arm at its longest completion: the Qwen2.5-0.5B shape with random
    weights (they never emit EOS: every completion is that long, the worst case the estimate plans
    for), one step (a second would take ~6 more minutes on 2 cores); its peak resident set against
    the estimate of a one-step run (bench_memory_estimate.estimate: AdamW's state or the
    activations, not both). Writes scripts/results/token_budget_confirm.json."""
    from bench_memory_estimate import estimate
    from bench_qwen_shape import run, shape_folder

    row = next(r for r in rows if r["arm"] == "budget")
    extra = [
        "trainer.prompts_per_step=4",
        "sampler.num_generations=8",
        f"sampler.max_new_tokens={row['largest_completion_tokens']}",
        "trainer.precision=fp32",
        f"trainer.micro_batch_tokens={budget}",
    ]
    one_step = estimate(shape_folder(harness.ROOT / ".bench", "qwen0.5b", weights=False), extra, "full", 1)
    measured = run(shape_folder(harness.ROOT / ".bench", "qwen0.5b"), 0.04, 1, OUT / "confirm", extra)
    out = row | {
        "one_step_estimate_gib": one_step["total"] / 2**30,
        "measured_gib": measured["peak_rss_gb"],
        "step_s": measured["first_step_s"],
        "wall_s": measured["wall_s"],
    }
    harness.print_table([out], list(out))
    notes = f"--fits --confirm --budget {budget}: one step run"
    print(f"wrote {harness.write_result('token_budget_confirm', [out], notes=notes)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1:])
        return 0
    if argv and argv[0] == "--fits":
        budget = int(argv[argv.index("--budget") + 1]) if "--budget" in argv else 1024
        rows = fits(float(argv[1]), budget)
        if "--confirm" in argv:
            confirm(rows, budget)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024)
    a = parser.parse_args(argv)
    rows, ratios = [], []
    for case in a.cases:
        for pair, arm in harness.interleave(["today", "budget"], a.pairs):
            rows.append(run_arm(case, arm, pair, a))
            print(json.dumps(rows[-1]), flush=True)
        for pair in range(a.pairs):
            today, budget = (
                next(r for r in rows if (r["case"], r["arm"], r["pair"]) == (case, arm, pair))
                for arm in ("today", "budget")
            )
            ratios.append(
                {
                    "case": case,
                    "pair": pair,
                    "phase_ratio": budget["phase_s"] / today["phase_s"],
                    "peak_ratio": budget["policy_peak_mib"] / max(today["policy_peak_mib"], 1e-9),
                }
            )
        mine = [r for r in ratios if r["case"] == case]
        ratios.append(
            {
                "case": case,
                "pair": "median",
                "phase_ratio": harness.median(r["phase_ratio"] for r in mine),
                "peak_ratio": harness.median(r["peak_ratio"] for r in mine),
            }
        )
    cols = [
        "case",
        "arm",
        "pair",
        "phase_s",
        "policy_peak_mib",
        "policy_peak_max_mib",
        "step_s",
        "completion_mean",
        "completion_max",
    ]
    harness.print_table(rows, cols)
    harness.print_table(ratios, ["case", "pair", "phase_ratio", "peak_ratio"])
    path = harness.write_result(
        "token_budget",
        rows + ratios,
        notes=f"{a.steps} steps per run (medians over steps 2-{a.steps}), budget {a.budget} tokens, {a.pairs} pairs",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
