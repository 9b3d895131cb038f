#!/usr/bin/env python
"""Full fine-tuning vs LoRA (adapter=lora, r=16, all linear layers) on SmolLM2-135M-Instruct.

    bash scripts/run.sh python scripts/bench_lora.py memory                 # peak RSS and step time
    bash scripts/run.sh python scripts/bench_lora.py accuracy --seeds 0 1 2 # held-out accuracy lift
    ... --json scripts/results/lora.json   (each part updates its own key of the file)

memory: the default recipe's shape (4 prompts x 8 completions x up to 16 tokens, fp32), beta 0
and 0.04, full and LoRA, without and with gradient checkpointing, each run by the real
grpo-train in a fresh process for --steps steps (no evaluation), interleaved; the process's
peak RSS (ru_maxrss: model loading included), the median step time (the first step is
warm-up), and grpo-check-env's estimate for the same settings (grpo_cli.memory, with the
data's longest prompt as the prompt length) next to it.

accuracy: the default recipe as it was until issue #20 (32 steps, full training at lr 1.5e-5;
greedy accuracy on the 200 held-out prompts before and after), full and LoRA (its own learning
rate, --lora-lr), for each seed.

A benchmark, not a test: nothing is asserted; it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import harness

LORA = ["adapter=lora"]  # r=16, alpha=32, all linear layers but the output head (conf/adapter/lora.yaml)


def grpo_train(args: list[str], out: Path) -> tuple[list[dict], float, float, str]:
    """grpo-train in a fresh process: (metrics rows, peak RSS in GiB, wall seconds, its output)."""
    done = harness.train(args, out)
    return harness.rows(out), done.peak_rss_kib / 2**20, done.wall_s, done.output


def longest_prompt() -> int:
    """Tokens of the default data's longest prompt (chat template included)."""
    from grpo_cli.build import build_data, build_tokenizer, read_data
    from grpo_cli.cli.common import typed_config

    cfg = typed_config([])
    _, tok = build_tokenizer(cfg, lambda *a: None)
    data = build_data(cfg, read_data(cfg), tok)
    return max(len(ex.prompt_ids) for ex in data.train + data.eval)


def estimate_gib(method: str, beta: float, prompt_length: int, gradient_checkpointing: bool) -> float:
    from grpo_cli import memory

    shape = memory.model_shape(memory.resolve_model_config("smollm2-135m"))
    e = memory.estimate(
        memory.EstimateInputs(
            shape,
            method,
            lora_r=16,
            precision="fp32",
            beta=beta,
            prompts_per_micro_batch=4,
            num_generations=8,
            prompt_length=prompt_length,
            completion_length=16,
            device_type="cpu",
            gradient_checkpointing=gradient_checkpointing,
            prompts_per_sampling_batch=4,
        )
    )
    return e.total / 2**30


def part_memory(args) -> dict:
    cases = [(m, b, gc) for gc in (False, True) for b in (0.0, 0.04) for m in ("full", "lora")]
    prompt_length = longest_prompt()
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for method, beta, gc in cases:
                key = f"{method} beta={beta:g}" + (" gc" if gc else "")
                overrides = (
                    LORA + [f"optimizer.learning_rate={args.lora_lr}"] if method == "lora" else []
                ) + [
                    f"loss.beta={beta}",
                    f"trainer.gradient_checkpointing={gc}",
                    "data.eval_size=0",
                    "trainer.eval_before=false",
                    f"trainer.max_steps={args.steps}",
                    f"trainer.save_steps={args.steps + 1}",
                    "trainer.quiet=true",
                ]
                rows, rss, wall, out = grpo_train(overrides, Path(tmp) / f"{rnd}-{method}-{beta}-{gc}")
                rows = [r for r in rows if "reward" in r]
                runs.setdefault(key, []).append(
                    {"rss_gib": rss, "step_s": [r["step_time"] for r in rows[1:]], "wall_s": wall}
                )
                print(f"  {key}: peak RSS {rss:.2f} GiB, steps {[round(r['step_time'], 2) for r in rows]}")
    results = []
    for (method, beta, gc), key in zip(cases, runs):
        r = runs[key]
        results.append(
            {
                "case": key,
                "method": method,
                "beta": beta,
                "gradient_checkpointing": gc,
                "peak_rss_gib": max(x["rss_gib"] for x in r),
                "median_step_s": statistics.median(s for x in r for s in x["step_s"]),
                "estimate_gib": estimate_gib(method, beta, prompt_length, gc),
            }
        )
    full = {(r["beta"], r["gradient_checkpointing"]): r for r in results if r["method"] == "full"}
    print(
        f"\nSmolLM2-135M-Instruct, default recipe shape, fp32, {args.steps} steps x {args.rounds} rounds; "
        f"LoRA r=16 all-linear at lr {args.lora_lr:g}; estimate at prompt length {prompt_length}"
    )
    print(
        f"{'case':<19} {'peak RSS GiB':>12} {'vs full':>8} {'step s':>7} {'vs full':>8} {'estimate':>9} {'est/meas':>9}"
    )
    for r in results:
        f = full[r["beta"], r["gradient_checkpointing"]]
        r["rss_vs_full"] = r["peak_rss_gib"] / f["peak_rss_gib"]
        r["step_vs_full"] = r["median_step_s"] / f["median_step_s"]
        r["estimate_vs_measured"] = r["estimate_gib"] / r["peak_rss_gib"]
        print(
            f"{r['case']:<19} {r['peak_rss_gib']:>12.2f} {r['rss_vs_full']:>8.2f} {r['median_step_s']:>7.2f} "
            f"{r['step_vs_full']:>8.2f} {r['estimate_gib']:>9.2f} {r['estimate_vs_measured']:>9.2f}"
        )
    return {"steps": args.steps, "rounds": args.rounds, "prompt_length": prompt_length, "results": results}


def part_accuracy(args) -> dict:
    results = []
    methods = [m for m in ("full", "lora") if m in args.methods]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for method in methods:
                # The recipe these figures were measured on (the default until issue #20): 32
                # steps, full training at 1.5e-5; no wide held-out set.
                overrides = (
                    LORA + [f"optimizer.learning_rate={args.lora_lr}"]
                    if method == "lora"
                    else ["optimizer.learning_rate=1.5e-5"]
                ) + [
                    f"trainer.seed={seed}",
                    "trainer.max_steps=32",
                    "data.wide_eval_max_operand=0",
                    "trainer.quiet=true",
                ]
                rows, rss, wall, out = grpo_train(overrides, Path(tmp) / f"{seed}-{method}")
                evals = [r for r in rows if "eval/accuracy" in r]
                before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
                results.append(
                    {
                        "method": method,
                        "seed": seed,
                        "before": before,
                        "after": after,
                        "lift": after - before,
                        "wall_s": wall,
                        "peak_rss_gib": rss,
                    }
                )
                print(
                    f"  {method} seed {seed}: {before:.3f} -> {after:.3f} ({after - before:+.3f}) in {wall:.0f} s"
                )
    print(f"\nDefault recipe (32 steps), held-out greedy accuracy (200 prompts); LoRA lr {args.lora_lr:g}")
    print(f"{'method':<6} {'seed':>4} {'before':>7} {'after':>7} {'lift':>7}")
    for r in results:
        print(f"{r['method']:<6} {r['seed']:>4} {r['before']:>7.3f} {r['after']:>7.3f} {r['lift']:>+7.3f}")
    mean = {m: statistics.mean(r["lift"] for r in results if r["method"] == m) for m in methods}
    for m, v in mean.items():
        print(f"mean lift {m}: {v:+.3f}")
    return {"lora_lr": args.lora_lr, "seeds": args.seeds, "results": results, "mean_lift": mean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("memory", "accuracy"))
    parser.add_argument("--steps", type=int, default=6, help="memory: steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="memory: runs of each case, interleaved")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="accuracy: trainer.seed values"
    )
    parser.add_argument("--methods", nargs="+", default=["full", "lora"], help="accuracy: full and/or lora")
    parser.add_argument("--lora-lr", type=float, default=2e-4, help="LoRA's optimizer.learning_rate")
    parser.add_argument("--json", help="write the results here (this part's key; the others are kept)")
    args = parser.parse_args()
    import torch
    import transformers

    result = (part_memory if args.part == "memory" else part_accuracy)(args)
    result["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[args.part] = result
        print(f"wrote {harness.write_json(path, data)}")


if __name__ == "__main__":
    main()
