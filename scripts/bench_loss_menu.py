#!/usr/bin/env python
"""The loss menu and on-policy distillation on the default recipe (issue #49).

    bash scripts/run.sh python scripts/bench_loss_menu.py menu
    bash scripts/run.sh python scripts/bench_loss_menu.py distill

menu: the default recipe (trainer defaults: 64 steps of 4 prompts x 8 = 2,048 sampled
completions, the default model and task) once per arm, arms alternating, one seed each (--seed):
grpo (the default), dapo, cispo, sapo, grpo with the entropy bonus (loss.entropy_coef,
--entropy-coef) and with TRL's adaptive entropy control at TRL's defaults. Per arm: held-out
greedy accuracy before and after (eval/accuracy), and the median step time. The grpo arm
evaluates every 8 steps (trainer.eval_steps=8): its readings at 256, 512 and 1,024 completions
are plain GRPO's curve for `distill`, and its last checkpoint is the teacher.

distill: the base model as the student, the grpo arm's final checkpoint as the teacher
(teacher.name_or_path, loss.teacher_kl=--teacher-kl), the rewards kept at weight 0 (pure
distillation; they still give eval/accuracy), 32 steps (1,024 completions), evaluated every 8
steps. Per reading: the student's held-out accuracy at 256, 512 and 1,024 completions against the
grpo arm's at the same counts, and the median step times.

Runs go to .bench/loss_menu/ (a finished run is reused: delete it to redo). Each mode prints a table
and writes scripts/results/loss_menu.json (harness schema), keeping the other mode's rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import harness

OUT = harness.ROOT / ".bench" / "loss_menu"
RESULT = harness.RESULTS / "loss_menu.json"
ARMS = {
    "grpo": ["trainer.eval_steps=8"],
    "dapo": ["loss=dapo"],
    "cispo": ["loss=cispo"],
    "sapo": ["loss=sapo"],
    "entropy": [],  # + loss.entropy_coef (main)
    # TRL's adaptive entropy control at TRL's defaults (target 0.2 nats, delta 0.005, from 0)
    "adaptive-entropy": ["loss.use_adaptive_entropy=true"],
}
READINGS = (8, 16, 32)  # steps: 256, 512 and 1,024 completions at 4 x 8 a step


def _finished(run, steps: int) -> list[dict]:
    """The run's rows when it ran to its final evaluation (at step `steps`); else it is removed, to
    run afresh."""
    metrics = harness.rows(run)
    if any("eval/accuracy" in r and r.get("step") == steps for r in metrics):
        return metrics
    shutil.rmtree(run, ignore_errors=True)
    return []


def _at(metrics: list[dict], step: int) -> float | None:
    return next((r["eval/accuracy"] for r in harness.eval_rows(metrics) if r.get("step") == step), None)


def _run(arm: str, overrides: list[str], seed: int, steps: int = 64) -> list[dict]:
    run = OUT / f"{arm}-s{seed}"
    metrics = _finished(run, steps)
    if not metrics:
        metrics = harness.launch([*overrides, f"trainer.seed={seed}"], run)
    return metrics


def menu(a) -> list[dict]:
    rows = []
    arms = dict(ARMS, entropy=[f"loss.entropy_coef={a.entropy_coef}"])
    for _, arm in harness.interleave(list(arms), 1):
        metrics = _run(arm, arms[arm], a.seed)
        evals, steps = harness.eval_rows(metrics), [r for r in metrics if "step_time" in r]
        rows.append(
            {
                "mode": "menu",
                "arm": arm,
                "overrides": arms[arm],
                "seed": a.seed,
                "completions": 32 * len(steps),
                "accuracy_before": evals[0]["eval/accuracy"],
                "accuracy_after": evals[-1]["eval/accuracy"],
                "step_time": harness.median(r["step_time"] for r in steps),
                "entropy_last8": harness.median(r["entropy"] for r in steps[-8:]),
                "entropy_coef_last": steps[-1].get("entropy_coef"),
            }
        )
        print(f"{arm}: {rows[-1]['accuracy_before']} -> {rows[-1]['accuracy_after']}", flush=True)
    harness.print_table(rows, ["arm", "accuracy_before", "accuracy_after", "step_time", "entropy_last8"])
    return rows


def distill(a) -> list[dict]:
    grpo_run = OUT / f"grpo-s{a.seed}"
    grpo = harness.rows(grpo_run)
    if not harness.eval_rows(grpo):
        raise SystemExit(f"run `menu` first: the grpo arm ({grpo_run}) is the teacher and the baseline")
    teacher = max((grpo_run / "checkpoints").glob("step-*"))
    overrides = [
        f"teacher.name_or_path={teacher}",
        f"loss.teacher_kl={a.teacher_kl}",
        "reward.accuracy.weight=0",
        "reward.format.weight=0",
        "trainer.max_steps=32",
        "trainer.eval_steps=8",
    ]
    student = _run("distill", overrides, a.seed, steps=32)
    steps = {name: [r for r in m if "step_time" in r] for name, m in (("distill", student), ("grpo", grpo))}
    rows = []
    for step in READINGS:
        rows.append(
            {
                "mode": "distill",
                "completions": 32 * step,
                "teacher": str(teacher.relative_to(harness.ROOT)),
                "teacher_accuracy": harness.eval_rows(grpo)[-1]["eval/accuracy"],
                "student_accuracy": _at(student, step),
                "grpo_accuracy": _at(grpo, step),
                "distill_step_time": harness.median(r["step_time"] for r in steps["distill"]),
                "grpo_step_time": harness.median(r["step_time"] for r in steps["grpo"][:32]),
                "teacher_kl_first": steps["distill"][0].get("teacher/kl"),
                "teacher_kl_last": steps["distill"][-1].get("teacher/kl"),
            }
        )
    harness.print_table(rows, [k for k in rows[0] if k not in ("mode", "teacher")])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("menu", "distill"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--teacher-kl", type=float, default=1.0)
    a = parser.parse_args(argv)
    rows = menu(a) if a.mode == "menu" else distill(a)
    kept = []
    if RESULT.is_file():
        kept = [r for r in json.loads(RESULT.read_text()).get("rows", []) if r.get("mode") != a.mode]
    notes = (
        "menu: the default recipe per loss, one seed, arms alternating; distill: pure on-policy "
        "distillation from the grpo arm's final checkpoint, held-out greedy accuracy at equal completions."
    )
    print(f"wrote {harness.write_result('loss_menu', kept + rows, notes=notes, path=RESULT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
