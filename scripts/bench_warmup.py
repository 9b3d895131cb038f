"""Issue #60's measurements: does a supervised warm-up make the default recipe's model better?

Arms (fresh grpo-train processes, the default recipe: 64 steps x 4 prompts x 8 = 2,048 sampled
completions, held-out greedy accuracy by kind and on the wide set):

    grpo       GRPO alone (the default recipe)
    sft_grpo   sft=demonstrations (one epoch of bare answers), then the default GRPO; its metrics
               hold three points: start -> after warm-up (= the warm-up alone) -> after GRPO
    sft_grpo_lr5e-5
               sft_grpo at the first learning rate tried (5e-5)
    sft_alone_lr1e-4
               the warm-up alone at the second (one GRPO step ends the run; its after-warm-up
               point is the measurement): 1e-4 became sft.learning_rate's default
    rg_mixed   reasoning-gym's default task configs mixed, the warm-up then GRPO (per task)
    sanity     the learnable band as a sanity check: the start model's 20-80% band (8 samples a
               prompt), 2,048 completions (trainer.epochs raised so the band's prompts fill 64
               steps); greedy accuracy on those training prompts (grpo-eval on them) and held out

    bash scripts/run.sh python scripts/bench_warmup.py grpo sft_grpo --seeds 0 1 2

Writes scripts/results/warmup.json (one row per arm and seed; rows of arms not run now are kept)
and prints a table. Each run takes minutes on a 2-core CPU: choose arms and seeds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics

import harness

OUT = harness.ROOT / ".bench" / "warmup"
RESULT = harness.RESULTS / "warmup.json"
ARMS = {
    "grpo": [],
    "sft_grpo": ["sft=demonstrations"],
    "sft_grpo_lr5e-5": ["sft=demonstrations", "sft.learning_rate=5e-5"],
    "sanity": ["data.pass_rate_band=[0.2,0.8]", "trainer.epochs=100"],
    # reasoning-gym at its default task configs (data=reasoning_gym: chain_sum, leg_counting,
    # letter_counting, spell_backward), mixed, the warm-up first; 480 training rows (30 warm-up
    # steps), 100 held out (25 a task), 32 new tokens: accuracy per task at the three points.
    "rg_mixed": [
        "data=reasoning_gym",
        "reward=[reasoning_gym]",
        "sampler.max_new_tokens=32",
        "sft=demonstrations",
        "data.options.size=480",
        "data.eval_size=100",
    ],
    # The warm-up alone at a learning rate (its after-warm-up point; one GRPO step ends the run).
    "sft_alone_lr1e-4": ["sft=demonstrations", "sft.learning_rate=1e-4", "trainer.max_steps=1"],
}


def _points(rows: list[dict]) -> dict:
    """start / after warm-up / after GRPO held-out accuracy (by kind, wide) of a run's rows."""
    evals = [r for r in rows if "eval/accuracy" in r]
    start = next((r for r in evals if r.get("phase") == "start"), None)
    before = next(r for r in evals if r.get("step") == 0 and r.get("phase") is None)
    last = evals[-1]

    def view(r):
        if r is None:
            return None
        kinds = {
            k.removeprefix("eval/accuracy/"): round(v, 3)
            for k, v in r.items()
            if k.startswith("eval/accuracy/")
        }
        return {"accuracy": r["eval/accuracy"], "wide": r.get("eval_wide/accuracy"), **kinds}

    sft_rows = [r for r in rows if r.get("phase") == "sft"]
    grpo_rows = [r for r in rows if "loss" in r]
    return {
        "start": view(start or before),
        "after_warm_up": view(before) if start else None,
        "after_grpo": view(last),
        "warm_up_s": round(sum(r.get("time/sft", 0.0) for r in sft_rows), 1),
        "warm_up_steps": len(sft_rows),
        "warm_up_last_loss": sft_rows[-1]["sft/loss"] if sft_rows else None,
        "grpo_s": round(
            sum(
                sum(v for k, v in r.items() if k.startswith("time/") and "/" not in k[5:]) for r in grpo_rows
            ),
            1,
        ),
        "grpo_steps": len(grpo_rows),
        "completions": 32 * len(grpo_rows),  # (4 prompts x 8 a step: the default recipe)
    }


def _band_train_accuracy(run_dir, seed: int) -> dict:
    """Greedy accuracy of the final checkpoint on the training prompts the band kept: grpo-eval's
    evaluator in this process, over those rows given as data.source=rows (a file would hold out
    at most a fifth of them)."""
    from grpo_cli.cli.common import compose_config
    from grpo_cli.cli.eval import evaluate_model
    from grpo_cli.config import DataConfig, to_typed
    from grpo_cli.data import rows as given
    from grpo_cli.data.arithmetic import rows as arithmetic_rows  # (the generator's own rows)

    harness.go_offline()
    band = json.loads((run_dir / "band.json").read_text())
    train, _ = arithmetic_rows(DataConfig(), seed)
    kept = [train[i] for i in band["kept"]]
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    given.given.train, given.given.eval = kept, kept
    try:
        cfg = to_typed(compose_config(["data=rows", f"model.name_or_path={final}", f"trainer.seed={seed}"]))
        result = evaluate_model(cfg, samples=0, num_prompts=None)
    finally:
        given.given.train = given.given.eval = None
    per_kind = {
        k.removeprefix("greedy_accuracy/"): round(v, 3)
        for k, v in result.items()
        if k.startswith("greedy_accuracy/")
    }
    return {
        "band_kept": len(kept),
        "band_groups": band["groups"],
        "band_probe_s": band["seconds"],
        "band_train_accuracy": result["greedy_accuracy"],
        "band_train_accuracy_by_kind": per_kind,
    }


def run_arm(arm: str, seed: int, fresh: bool) -> dict:
    run_dir = OUT / f"{arm}-seed{seed}"
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    if not (run_dir / "metrics.jsonl").exists() or not list((run_dir / "checkpoints").glob("step-*")):
        shutil.rmtree(run_dir, ignore_errors=True)
        harness.train([*ARMS[arm], f"trainer.seed={seed}"], run_dir, timeout_s=3600)
    row = {"arm": arm, "seed": seed, "overrides": ARMS[arm], **_points(harness.rows(run_dir))}
    if arm == "sanity":
        row |= _band_train_accuracy(run_dir, seed)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs of these arms first")
    args = parser.parse_args()
    random.seed(0)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            row = run_arm(arm, seed, args.fresh)
            rows.append(row)
            print(json.dumps(row), flush=True)
    kept = json.loads(RESULT.read_text())["rows"] if RESULT.exists() else []
    done = {(r["arm"], r["seed"]) for r in rows}
    kept = [r for r in kept if (r["arm"], r["seed"]) not in done]
    every = kept + rows
    for arm in ARMS:
        finals = [r["after_grpo"]["accuracy"] for r in every if r["arm"] == arm]
        if finals:
            print(
                f"{arm:9s} after GRPO: median {statistics.median(finals):.3f} over {len(finals)} seed(s): {finals}"
            )
    harness.print_table(every, ["arm", "seed", "start", "after_warm_up", "after_grpo", "warm_up_s", "grpo_s"])
    print(f"wrote {harness.write_result('warmup', every, path=RESULT)}")


if __name__ == "__main__":
    main()
