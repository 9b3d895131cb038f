#!/usr/bin/env python
"""The memory estimate (grpo-check-env --model ...) against the measured peak of a real step.

    bash scripts/run.sh python scripts/bench_memory_estimate.py                 # the default table
    bash scripts/run.sh python scripts/bench_memory_estimate.py --models smollm2-135m --lengths 256
    bash scripts/run.sh python scripts/bench_memory_estimate.py --chunks auto 0 --json out.json

Per case, a random-init model of a real shape (scripts/bench_qwen_shape.py's SHAPES: SmolLM2-135M,
Qwen2.5-0.5B, Qwen2.5-1.5B; no hub) trains two steps of the real `grpo-train` in a fresh process
(the second with AdamW's state alive, as in every later step; --steps 1 where a step is long, whose
peak is the larger of its backward and its first update: see estimate()):
one prompt of the default recipe, 8 completions of exactly --lengths tokens (EOS ignored), beta
0.04, AdamW, with the precision and trainer.logprob_chunk_size of the case. The measured peak is
the process's peak resident set (ru_maxrss: the weights, the reference, the gradients and the
optimizer state, the sampler's cache, the training forward's activations, the runtime). The
estimate is what `grpo-check-env --model <folder> <the same overrides>` prints for the method the
run used (cli.check_env.memory_estimate: nothing loaded). Full fine-tuning where it fits this
machine, LoRA (adapter=lora, r 16) for the 1.5B shape, whose full fine-tuning needs ~30 GB.

Prints a table (estimate, measured, their ratio) and writes the result, one row per case
(harness.write_result: scripts/results/memory_estimate.json, --largest's
scripts/results/memory_largest.json; --json elsewhere). A benchmark: nothing is asserted; the ratio
is what docs/precision.md reports.

    ... bench_memory_estimate.py --reestimate scripts/results/memory_estimate.json   # runs nothing
    ... bench_memory_estimate.py --largest 16 --models qwen0.5b --chunks auto 0 # runs nothing

--reestimate FILE recomputes the estimate column of FILE's rows with this tree's grpo_cli.memory
(after a recalibration: the measured peaks stay). --largest GIB bisects, for each model, precision
and chunk setting, the longest completion (8 of them, one prompt) whose estimate is within GIB GiB:
the estimate, checked against the measured rows, stands in for a run per length.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import harness
from bench_qwen_shape import SHAPES, run, shape_folder  # one source for the shapes

# Full fine-tuning of the 1.5B shape (fp32 weights, gradients, AdamW, a reference: ~30 GB) does not
# fit a 24 GiB machine; LoRA is what grpo-check-env recommends there, and what is measured.
METHOD = {"smollm2-135m": "full", "qwen0.5b": "full", "qwen1.5b": "lora"}


def overrides(precision: str, length: int, chunk: str, method: str, gc: bool = False) -> list[str]:
    extra = [
        "trainer.prompts_per_step=1",
        "trainer.gradient_accumulation_steps=1",
        "sampler.num_generations=8",
        f"sampler.max_new_tokens={length}",
        "sampler.ignore_eos=true",
        f"trainer.precision={precision}",
        f"trainer.logprob_chunk_size={'null' if chunk == 'auto' else chunk}",
        f"trainer.gradient_checkpointing={str(gc).lower()}",
    ]
    return extra + (["adapter=lora"] if method == "lora" else [])


def estimate(folder: Path, extra: list[str], method: str, steps: int = 2) -> dict:
    """What grpo-check-env --model <folder> <extra> estimates for `method`, in bytes. A one-step run
    never holds AdamW's state and a step's activations at once (AdamW allocates its state in the
    first update, after the backward freed the activations), so its peak is the larger of the two
    phases: the total less the optimizer's state (the backward's peak, where the activations are
    large) or less the activations (the update's, where the layers are checkpointed)."""
    from grpo_cli.cli.check_env import memory_estimate

    info = {"cuda_available": False, "bf16_supported": True, "ram_gib": 24.0, "vram_gib": None}
    full = memory_estimate(str(folder), [*extra, "loss.beta=0.04"], info)
    est = full["methods"][method] | {"prompt_length": full["settings"]["prompt_length"]}
    if steps == 1:
        est["total"] -= min(est["optimizer"], est["activations"])
    return est


def _parts_gib(est: dict) -> dict:
    """The estimate's byte terms (weights, gradients, ..., total) in GiB."""
    return {
        k: v / 2**30
        for k, v in est.items()
        if isinstance(v, int) and not isinstance(v, bool) and k != "prompt_length"
    }


def reestimate(path: Path) -> None:
    """The estimate of every row of a JSON this script wrote, recomputed (measured peaks kept)."""
    data = json.loads(path.read_text())
    for r in data["rows"]:
        folder = shape_folder(harness.ROOT / ".bench", r["model"], weights=False)
        gc = r.get("gradient_checkpointing", False)
        extra = overrides(r["precision"], r["completion_tokens"], r["chunk"], r["method"], gc)
        est = estimate(folder, extra, r["method"], r.get("steps", 2))
        r["estimate_gib"] = est["total"] / 2**30
        r["estimate_parts_gib"] = _parts_gib(est)
        r["ratio"] = r["estimate_gib"] / r["measured_gib"]
    harness.write_json(path, data)
    _table(data["rows"])
    print(f"re-estimated {path}")


def _fits(folder: Path, precision: str, length: int, chunk: str, method: str, budget: float) -> bool:
    return estimate(folder, overrides(precision, length, chunk, method), method)["total"] <= budget


def largest(budget_gib: float, models, precisions, chunks) -> list[dict]:
    """The longest completion length (8 completions of one prompt) whose estimate fits budget_gib."""
    rows = []
    for model in models:
        folder, method = shape_folder(harness.ROOT / ".bench", model, weights=False), METHOD[model]
        for precision in precisions:
            for chunk in chunks:
                lo, hi = 0, 1 << 16  # lo fits (or is 0), hi does not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if _fits(folder, precision, mid, chunk, method, budget_gib * 2**30):
                        lo = mid
                    else:
                        hi = mid
                row = dict(model=model, method=method, precision=precision, chunk=chunk)
                rows.append(row | dict(budget_gib=budget_gib, largest_completion_tokens=lo))
                print(f"{model} {method} {precision} chunk {chunk}: within {budget_gib:g} GiB up to 8 x {lo}")
    return rows


def _table(rows) -> None:
    print(
        f"\n{'model':<14}{'method':<7}{'precision':<10}{'tokens':>8}{'chunk':>7}{'estimate GiB':>14}"
        f"{'measured GiB':>14}{'est/meas':>10}"
    )
    for r in rows:
        chunk = r["chunk"] + (" gc" if r.get("gradient_checkpointing") else "")
        print(
            f"{r['model']:<14}{r['method']:<7}{r['precision']:<10}{'8x' + str(r['completion_tokens']):>8}"
            f"{chunk:>7}{r['estimate_gib']:>14.2f}{r['measured_gib']:>14.2f}{r['ratio']:>10.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["smollm2-135m", "qwen0.5b", "qwen1.5b"], choices=SHAPES
    )
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024], help="completion tokens")
    parser.add_argument(
        "--chunks", nargs="+", default=["auto"], help="logprob_chunk_size values (auto, 0, N)"
    )
    parser.add_argument(
        "--shapes-dir", default=str(harness.ROOT / ".bench"), help="where the models are built (once)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        choices=[1, 2],
        help="training steps per run (1: where one step is long; its estimate holds AdamW's state "
        "or the activations, not both)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="trainer.gradient_checkpointing=true in every run (and its estimate)",
    )
    parser.add_argument(
        "--json",
        help="write the result here (default scripts/results/memory_estimate.json, memory_largest.json)",
    )
    parser.add_argument("--reestimate", metavar="FILE", help="recompute FILE's estimates; run nothing")
    parser.add_argument(
        "--largest", type=float, metavar="GIB", help="longest completion within GIB; run nothing"
    )
    args = parser.parse_args()
    harness.go_offline()  # (the estimates read model folders in this process)
    if args.reestimate:
        return reestimate(Path(args.reestimate))
    if args.largest:
        rows = largest(args.largest, args.models, args.precisions, args.chunks)
        path = args.json or harness.RESULTS / "memory_largest.json"
        notes = f"--largest {args.largest:g}: estimates only, nothing run"
        return print(f"wrote {harness.write_result('memory_estimate', rows, notes=notes, path=path)}")
    rows, gc = [], args.gradient_checkpointing
    for model in args.models:
        folder = shape_folder(Path(args.shapes_dir), model)
        for length in args.lengths:
            for precision in args.precisions:
                for chunk in args.chunks:
                    method = METHOD[model]
                    extra = overrides(precision, length, chunk, method, gc)
                    est = estimate(folder, extra, method, args.steps)
                    print(
                        f"[bench] {model} {precision} 8 x {length} chunk {chunk}{' gc' if gc else ''} ({method}) ...",
                        flush=True,
                    )
                    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
                        measured = run(folder, 0.04, args.steps, Path(tmp) / "run", extra)
                    row = {
                        "model": model,
                        "method": method,
                        "precision": precision,
                        "completion_tokens": length,
                        "chunk": chunk,
                        "gradient_checkpointing": gc,
                        "steps": args.steps,
                        "estimate_gib": est["total"] / 2**30,
                        "estimate_parts_gib": _parts_gib(est),
                        "measured_gib": measured["peak_rss_gb"],
                        "step_s": measured["median_step_s"],
                    }
                    row["ratio"] = row["estimate_gib"] / row["measured_gib"]
                    print(
                        f"[bench]   estimate {row['estimate_gib']:.2f} GiB, measured {row['measured_gib']:.2f} GiB "
                        f"({row['ratio']:.2f}x), step {row['step_s']:.0f} s",
                        flush=True,
                    )
                    rows.append(row)
    _table(rows)
    print(f"wrote {harness.write_result('memory_estimate', rows, path=args.json)}")


if __name__ == "__main__":
    main()
