#!/usr/bin/env python
"""Behaviour unchanged? Four short fixed-seed runs recorded bit for bit, to hold a restructure to
(issue #47's notes: the golden tests run only on one CPU kind; this baseline runs on any).

    bash scripts/run.sh python scripts/bench_baseline.py            # record (or re-record) this machine's
    bash scripts/run.sh python scripts/bench_baseline.py --check    # re-run, compare with the record

The runs, each trainer.seed=0, no held-out evaluation, a checkpoint at the last step:
  default      the default recipe (SmolLM2-135M, arithmetic, 4 prompts x 8), 8 steps
  calculator   environment=calculator, 4 steps
  dynamic      trainer.dynamic_sampling=true, 4 steps
  adaptive     sampler.max_generations=16 (adaptive group sizes), 4 steps
Per run it keeps every step's loss, reward, per-reward means, grad norm and completions sampled,
and a sha256 of the final checkpoint's weights. The record is
scripts/results/baseline-<machine key>.json: a trajectory depends on the CPU's vector units and the
library versions (harness.fingerprint), so each machine kind keeps its own, and --check compares
only with this machine's. Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import harness

COMMON = ["trainer.seed=0", "trainer.eval_before=false", "data.eval_size=0", "trainer.quiet=true"]
RUNS = {
    "default": ["trainer.max_steps=8", "trainer.save_steps=8"],
    "calculator": ["environment=calculator", "trainer.max_steps=4", "trainer.save_steps=4"],
    "dynamic": ["trainer.dynamic_sampling=true", "trainer.max_steps=4", "trainer.save_steps=4"],
    "adaptive": ["sampler.max_generations=16", "trainer.max_steps=4", "trainer.save_steps=4"],
}
KEPT = ("step", "loss", "reward", "grad_norm", "num_completions_sampled")


def record(name: str, overrides: list[str], folder: Path) -> dict:
    tick = time.perf_counter()
    run_dir = folder / name
    steps = harness.launch([*COMMON, *overrides], run_dir)
    steps = [r for r in steps if "loss" in r]
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    weights = sorted(checkpoint.glob("*.safetensors"))
    return {
        "run": name,
        "overrides": overrides,
        "steps": [
            {
                **{k: r.get(k) for k in KEPT},
                **{k: v for k, v in r.items() if k.startswith("rewards/") and k.endswith("/mean")},
            }
            for r in steps
        ],
        "weights_sha256": harness.file_hash(weights),
        "seconds": round(time.perf_counter() - tick, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with this machine's record")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    path = harness.RESULTS / f"baseline-{harness.machine_key()}.json"
    with tempfile.TemporaryDirectory(prefix="grpo-baseline-") as tmp:
        results = [record(name, RUNS[name], Path(tmp)) for name in args.runs]
    harness.print_table(
        [
            {
                "run": r["run"],
                "steps": len(r["steps"]),
                "final loss": r["steps"][-1]["loss"],
                "weights": r["weights_sha256"][:12],
                "seconds": r["seconds"],
            }
            for r in results
        ],
        ["run", "steps", "final loss", "weights", "seconds"],
    )
    if not args.check:
        out = harness.write_result(
            "baseline", results, path=path, notes="per-step metrics and final weights of four fixed-seed runs"
        )
        print(f"wrote {out}")
        return 0
    if not path.is_file():
        print(f"no record for this machine ({path.name}); run without --check first", file=sys.stderr)
        return 2
    import json

    recorded = {r["run"]: r for r in json.loads(path.read_text())["rows"]}
    differs = 0
    for r in results:
        old = recorded.get(r["run"])
        same = old is not None and (old["steps"], old["weights_sha256"]) == (r["steps"], r["weights_sha256"])
        differs += not same
        print(f"{r['run']}: {'equal bit for bit' if same else 'DIFFERS from the record'}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
