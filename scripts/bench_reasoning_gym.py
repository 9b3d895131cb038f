#!/usr/bin/env python
"""Which reasoning-gym tasks give the default model a learning signal, and does mixing them help?

    GRPO_EXTRAS=reasoning-gym bash scripts/run.sh python scripts/bench_reasoning_gym.py scan
    GRPO_EXTRAS=reasoning-gym bash scripts/run.sh python scripts/bench_reasoning_gym.py train \
        chain_sum leg_counting letter_counting

scan: for each task given (default: eight cheap tasks with short answers), one `grpo-eval` of the
base model (no --checkpoint; the default model unless --set model=...) with data=reasoning_gym
restricted to that task and reward=[reasoning_gym]: --num-prompts held-out prompts (default 100),
--samples per prompt (default 8) at the training sampler's settings, sampler.max_new_tokens
--max-new-tokens (default 64), sampler.max_prompt_length --max-prompt-length (default 512: the
sorting and counting prompts run long). Per task: the mean per-sample accuracy (grpo-eval's
pass@1: the share of sampled completions the task's scorer gives 1.0), pass@G, greedy accuracy,
the mean score (part marks included), and whether pass@1 is inside 10%-90%, where GRPO gets a
signal.

train: for the three tasks given, three single-task runs and one mixed run (the three, equal
weights) with the default recipe (trainer defaults: 64 steps of 4 prompts x 8), one seed each
(--seed). Per run: held-out greedy accuracy per task before and after (eval/accuracy/<task>) and
the median step time. The mixed run's own held-out set is a mix; so that its accuracy compares
with the single-task runs', its last checkpoint is also evaluated (greedy, grpo-eval
model.name_or_path=<checkpoint>) on each single-task run's held-out set (the same options and
seed give the same rows).

Runs go to .bench/reasoning_gym/ (a run or scan result already there is reused: delete it to
redo). Both modes print a table and write scripts/results/reasoning_gym.json (harness schema),
keeping the other mode's rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import harness

OUT = harness.ROOT / ".bench" / "reasoning_gym"
RESULT = harness.RESULTS / "reasoning_gym.json"
CANDIDATES = (
    "basic_arithmetic",
    "chain_sum",
    "leg_counting",
    "letter_counting",
    "spell_backward",
    "number_sorting",
    "word_sorting",
    "simple_equations",
)
#: Easier configs (--easy) for tasks whose defaults the 135M model never solves (the first scan):
#: two terms of one or two digits, one or two animals, short words, a yes/no task; each with room
#: for 100 held-out questions that no training row repeats. Chosen before the scan.
EASY = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
    "letter_counting": {"min_words": 1, "max_words": 3},
    "ransom_note": {"max_note_length": 3, "max_magazine_length": 8},
}
PRESET = ["data=reasoning_gym", "reward=[reasoning_gym]"]
LOCAL_MODEL = ("gguf_file", "offline_wheel", "offline_gguf")  # a checkpoint folder needs none


def _hydra(value) -> str:
    """A value in Hydra's override grammar."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, list):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    return str(value)


def tasks_override(tasks: list[str], easy: bool = False) -> str:
    """data.options.tasks for these names: each with its EASY config where easy is set."""
    items = [_hydra({"name": t, "config": EASY[t]}) if easy and t in EASY else t for t in tasks]
    return f"data.options.tasks=[{','.join(items)}]"


def grpo_eval(args: list[str], output: Path) -> dict:
    """One grpo-eval in a fresh process; its JSON result (reused when `output` exists)."""
    if output.is_file():
        return json.loads(output.read_text())
    output.parent.mkdir(parents=True, exist_ok=True)
    harness.run(harness.program("grpo-eval", *args, "--output", output), name=f"grpo-eval {' '.join(args)}")
    return json.loads(output.read_text())


def scan(a) -> list[dict]:
    rows = []
    for task in a.tasks:
        overrides = [
            *PRESET,
            tasks_override([task], a.easy),
            f"data.eval_size={a.num_prompts}",
            "data.options.size=200",  # only the held-out rows are used; training rows are deduped against
            f"sampler.max_new_tokens={a.max_new_tokens}",
            f"sampler.max_prompt_length={a.max_prompt_length}",
            f"trainer.seed={a.seed}",
            *a.set,
        ]
        flags = ["--samples", str(a.samples), "--num-prompts", str(a.num_prompts)]
        r = grpo_eval([*overrides, *flags], OUT / "scan" / f"{task}{'-easy' if a.easy else ''}.json")
        G = r.get("samples_per_prompt", a.samples)
        rows.append(
            {
                "mode": "scan",
                "task": task,
                "config": EASY.get(task, {}) if a.easy else {},
                "model": r["model"],
                "num_prompts": r["num_prompts"],
                "samples": G,
                "max_new_tokens": a.max_new_tokens,
                "accuracy": r.get("pass@1"),  # mean per-sample accuracy (pass: score 1.0)
                f"pass@{G}": r.get(f"pass@{G}"),
                "greedy_accuracy": r["greedy_accuracy"],
                "mean_score": r.get("sampled_reward"),  # part marks included
                "mean_length": r.get("sampled_mean_length"),
                "in_band": r.get("pass@1") is not None and 0.10 <= r["pass@1"] <= 0.90,
                "seconds": r["seconds"],
            }
        )
        print(f"{task}: accuracy {rows[-1]['accuracy']:.3f} ({r['num_prompts']} prompts x {G})", flush=True)
    rows.sort(key=lambda row: -(row["accuracy"] or 0.0))
    columns = ["task", "accuracy", f"pass@{a.samples}", "greedy_accuracy", "mean_score", "mean_length"]
    harness.print_table(rows, [*columns, "in_band", "num_prompts"])
    return rows


def train(a) -> list[dict]:
    if len(a.tasks) != 3:
        raise SystemExit(f"train takes three task names, got {len(a.tasks)}: {' '.join(a.tasks)}")
    base = [
        *PRESET,
        f"trainer.seed={a.seed}",
        f"sampler.max_new_tokens={a.max_new_tokens}",
        f"sampler.max_prompt_length={a.max_prompt_length}",
        *a.set,
    ]
    arms = {task: [task] for task in a.tasks}
    arms["mixed"] = list(a.tasks)
    rows = []
    for arm, tasks in arms.items():
        run = OUT / "train" / f"{arm}{'-easy' if a.easy else ''}-s{a.seed}"
        metrics = harness.rows(run)
        if len(harness.eval_rows(metrics)) < 2:  # not run, or stopped before its last evaluation: run afresh
            shutil.rmtree(run, ignore_errors=True)
            metrics = harness.launch([*base, tasks_override(tasks, a.easy)], run)
        evals, steps = harness.eval_rows(metrics), [r for r in metrics if "step_time" in r]
        first, last = evals[0], evals[-1]
        row = {
            "mode": "train",
            "arm": arm,
            "tasks": tasks,
            "configs": {t: EASY.get(t, {}) for t in tasks} if a.easy else {},
            "seed": a.seed,
            "steps": steps[-1]["step"] if steps else 0,
            "step_time": harness.median(r["step_time"] for r in steps),
            "accuracy_before": first.get("eval/accuracy"),
            "accuracy_after": last.get("eval/accuracy"),
        }
        for task in tasks:
            row[f"before/{task}"] = first.get(f"eval/accuracy/{task}")
            row[f"after/{task}"] = last.get(f"eval/accuracy/{task}")
        if arm == "mixed":  # its last checkpoint on each single-task held-out set
            checkpoint = max((run / "checkpoints").glob("step-*"))
            for task in tasks:
                # The checkpoint as a plain model folder with the single-task run's overrides: a
                # checkpoint's saved config (grpo-eval --checkpoint) takes no list override.
                as_model = [f"model.name_or_path={checkpoint}", *(f"model.{k}=null" for k in LOCAL_MODEL)]
                r = grpo_eval(
                    [*base, tasks_override([task], a.easy), *as_model, "--samples", "0"],
                    OUT / "train" / f"mixed{'-easy' if a.easy else ''}-s{a.seed}-on-{task}.json",
                )
                row[f"after_on_single/{task}"] = r["greedy_accuracy"]
        rows.append(row)
        print(f"{arm}: accuracy {row['accuracy_before']} -> {row['accuracy_after']}", flush=True)
    table = []
    for task in a.tasks:
        single = next(r for r in rows if r["arm"] == task)
        mixed = rows[-1]
        table.append(
            {
                "task": task,
                "before": single[f"before/{task}"],
                "single_after": single[f"after/{task}"],
                "mixed_after": mixed[f"after_on_single/{task}"],
                "mixed_after_own_set": mixed[f"after/{task}"],
                "single_step_time": single["step_time"],
                "mixed_step_time": mixed["step_time"],
            }
        )
    harness.print_table(table, list(table[0]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("scan", "train"))
    parser.add_argument("tasks", nargs="*", help=f"scan: default {' '.join(CANDIDATES)}; train: three")
    parser.add_argument("--num-prompts", type=int, default=100, help="scan: held-out prompts per task")
    parser.add_argument("--samples", type=int, default=8, help="scan: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--max-prompt-length", type=int, default=512, help="sorting and counting prompts run long"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--easy", action="store_true", help=f"the EASY configs of {', '.join(EASY)}")
    parser.add_argument("--set", action="append", default=[], help="an extra override (repeatable)")
    a = parser.parse_args(argv)
    if a.mode == "scan" and not a.tasks:
        a.tasks = list(CANDIDATES)
    rows = scan(a) if a.mode == "scan" else train(a)
    kept = []
    if RESULT.is_file():  # the other mode's rows stay
        old = json.loads(RESULT.read_text()).get("rows", [])
        kept = [r for r in old if r.get("mode") != a.mode or bool(r.get("easy")) != a.easy]
    for r in rows:
        r["easy"] = a.easy
    notes = (
        "scan: grpo-eval of the base model per task (accuracy = mean per-sample accuracy, pass = the "
        "task's scorer gives 1.0); train: default recipe, single-task runs and one equal-weight mix, "
        "held-out greedy accuracy per task (mixed: also on each single-task held-out set)."
    )
    print(f"wrote {harness.write_result('reasoning_gym', kept + rows, notes=notes, path=RESULT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
