#!/usr/bin/env python
"""trainer.micro_batch_tokens=auto on the Qwen2.5-0.5B shape (random weights) under a memory limit
(issue #62).

    bash scripts/run.sh python scripts/bench_fit.py                      # 16 GiB, 2 steps, 256 tokens
    bash scripts/run.sh python scripts/bench_fit.py --limit 16 --steps 2 --tokens 256

One fresh grpo-train process: 4 prompts x 8 completions x --tokens new tokens (random weights never
emit EOS: every completion runs to the limit, the worst case), fp32, loss.beta 0, full fine-tuning,
trainer.micro_batch_tokens=auto with trainer.memory_limit_gib=--limit. Reported: the plan the probe
made (the run folder's memory_plan.json: budget, micro-batches, predicted peak, the probes' peaks),
the process's peak resident set (wait4's ru_maxrss, the model's load included) against the limit,
and the step times. Where the plan refuses (one group cannot fit), the refusal paragraph, then the
same run with the lever named by --lever (default: the first lever the paragraph names). Prints a
table; writes scripts/results/fit.json. A benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil

import harness
from bench_qwen_shape import shape_folder

OUT = harness.ROOT / ".bench" / "fit"


def one(folder, a, extra: list[str], name: str) -> dict:
    run_dir = OUT / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [
        f"model.name_or_path={folder}",
        "data.eval_size=0",
        "trainer.eval_before=false",
        f"trainer.max_steps={a.steps}",
        f"trainer.save_steps={a.steps + 1}",
        "trainer.keep_last=1",
        "reward=[length]",  # (random weights answer nothing right: lengths give every group a spread)
        "reward.length.unit=chars",
        "loss.beta=0",
        "optimizer.learning_rate=1e-6",
        "trainer.prompts_per_step=4",
        "sampler.num_generations=8",
        f"sampler.max_new_tokens={a.tokens}",
        "sampler.ignore_eos=true",
        "trainer.precision=fp32",
        "trainer.micro_batch_tokens=auto",
        f"trainer.memory_limit_gib={a.limit:g}",
        *extra,
    ]
    done = harness.train(args, run_dir, name=name, check=False)
    out = done.stdout + done.stderr
    row = {
        "arm": name,
        "overrides": " ".join(extra),
        "returncode": done.returncode,
        "peak_rss_gib": done.peak_rss_kib / 2**20,
        "limit_gib": a.limit,
        "wall_s": done.wall_s,
    }
    refused = re.search(r"trainer\.micro_batch_tokens=auto: one group cannot fit.*", out)
    if refused:
        return row | {"refusal": refused.group(0).strip()}
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out[-3000:]}")
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    steps = harness.step_rows(run_dir)
    return row | {
        "budget": plan["budget"],
        "micro_batches": plan["micro_batches"],
        "predicted_peak_gib": plan["predicted_peak_bytes"] / 2**30,
        "probe_peaks_gib": [p / 2**30 for _, p in plan["probes"]],
        "probe_tokens": [t for t, _ in plan["probes"]],
        "optimizer_gib": plan["optimizer_bytes"] / 2**30,
        "mib_per_token": plan["bytes_per_token"] / 2**20,
        "steps": len(steps),
        "step_s": [r["step_time"] for r in steps],
        "under_limit": done.peak_rss_kib / 2**20 <= a.limit,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=float, default=16.0, help="trainer.memory_limit_gib")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--lever", default=None, help="the override to retry with after a refusal")
    a = p.parse_args()
    folder = shape_folder(harness.ROOT / ".bench", "qwen0.5b")
    rows = [one(folder, a, [], "auto")]
    print(json.dumps(rows[-1]), flush=True)
    if "refusal" in rows[-1]:
        print(rows[-1]["refusal"], flush=True)
        lever = a.lever or re.search(r"Levers that lower the peak: ([^ ;(]+)", rows[-1]["refusal"]).group(1)
        rows.append(one(folder, a, [lever], "auto+lever"))
        print(json.dumps(rows[-1]), flush=True)
    columns = [
        "arm",
        "overrides",
        "budget",
        "micro_batches",
        "predicted_peak_gib",
        "peak_rss_gib",
        "limit_gib",
    ]
    harness.print_table(rows, columns + ["optimizer_gib", "mib_per_token", "wall_s"])
    notes = (
        f"Qwen2.5-0.5B shape, random weights, 4x8x{a.tokens} (ignore_eos), fp32, beta 0, full fine-tuning, "
        f"trainer.micro_batch_tokens=auto, trainer.memory_limit_gib={a.limit:g}, {a.steps} steps, one fresh process "
        "per arm; peak_rss_gib is wait4's ru_maxrss (the load included)."
    )
    print(f"wrote {harness.write_result('fit', rows, notes=notes)}")


if __name__ == "__main__":
    main()
