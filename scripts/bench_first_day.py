#!/usr/bin/env python
"""A user's own task on the first day (issue #59), run as the docs say, on the default model
(SmolLM2-135M-Instruct, offline): held-out accuracy before and after each journey.

    bash scripts/run.sh python scripts/bench_first_day.py [--steps N] [journey ...]

journeys (default: all three):
  jsonl          README "Your own task": a JSON Lines file of questions with an `answer` column and
                 a TRL-style reward in my_rewards.py in the working directory (found without
                 PYTHONPATH), beside the task's accuracy: grpo-train data=jsonl data.path=qa.jsonl
                 +reward.exact.fn=my_rewards:exact (the task's defaults: 256 tokens, [accuracy])
  reasoning_gym  docs/reasoning-gym.md's first command: grpo-train experiment=reasoning_gym
  python         docs/python-api.md: grpo_cli.train(...) with a callable reward beside accuracy (the
                 correctness reward that held-out accuracy reads) and rows in memory

Each run evaluates greedily before and after (eval_before, 200 held-out prompts where the data has
them). --steps overrides trainer.max_steps for the jsonl and python journeys (default 32, half
the default recipe's 64, so that each takes minutes on 2 cores); reasoning_gym runs the
experiment as shipped (64 steps). Runs go to .bench/first_day/<journey> (a finished one is reused:
delete it to redo). Prints a table and writes scripts/results/first_day.json (harness schema).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import textwrap
from pathlib import Path

import harness

OUT = harness.ROOT / ".bench" / "first_day"
RESULT = harness.RESULTS / "first_day.json"
JOURNEYS = ("jsonl", "reasoning_gym", "python")

# The user's reward, as a TRL user writes one (TRL's signature; `answer` is the file's column).
MY_REWARDS = '''
def exact(completions, answer, **kwargs):
    """1.0 when the reply is the answer alone (the model's text stripped), else 0.0."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if t.strip().rstrip(".") == str(a) else 0.0 for t, a in zip(texts, answer)]
'''


def qa_rows(seed: int = 0) -> list[dict]:
    """A user's own file: 600 questions "Compute a + b. Reply with the number only." (a, b up to 30,
    + and -), in words the built-in arithmetic does not use, each with its answer."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < 600:
        a, b, op = rng.randint(0, 30), rng.randint(0, 30), rng.choice("+-")
        if (a, b, op) in seen:
            continue
        seen.add((a, b, op))
        value = a + b if op == "+" else a - b
        rows.append({"prompt": f"Compute {a} {op} {b}. Reply with the number only.", "answer": str(value)})
    return rows


def _before_after(run_dir: Path) -> dict:
    rows = [r for r in harness.rows(run_dir) if "eval/accuracy" in r]
    if len(rows) < 2:
        raise SystemExit(f"{run_dir}: no held-out accuracy before and after in metrics.jsonl")
    first, last = rows[0], rows[-1]
    per = sorted(k for k in last if k.startswith("eval/accuracy/"))
    return {
        "before": first["eval/accuracy"],
        "after": last["eval/accuracy"],
        "per_group": {k.removeprefix("eval/accuracy/"): (first.get(k), last[k]) for k in per},
        "steps": max(r.get("step", 0) for r in harness.rows(run_dir)),
    }


def jsonl(steps: int) -> dict:
    folder = OUT / "jsonl"
    run_dir = folder / "run"
    if not (run_dir / "metrics.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa_rows()))
        (folder / "my_rewards.py").write_text(MY_REWARDS.lstrip())
        overrides = ["data=jsonl", "data.path=qa.jsonl", "+reward.exact.fn=my_rewards:exact"]
        harness.train([*overrides, f"trainer.max_steps={steps}", "data.eval_size=100"], run_dir, cwd=folder)
    # (steps: as run, read back from the metrics)
    return {
        "command": "grpo-train data=jsonl data.path=qa.jsonl +reward.exact.fn=my_rewards:exact",
        **_before_after(run_dir),
    }


def reasoning_gym(steps: int) -> dict:
    run_dir = OUT / "reasoning_gym"
    if not (run_dir / "metrics.jsonl").exists():
        harness.train(["experiment=reasoning_gym"], run_dir)
    return {"command": "grpo-train experiment=reasoning_gym", **_before_after(run_dir)}


CHILD = """
import json, random, sys
import grpo_cli

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip().rstrip(".") == str(a) else 0.0 for c, a in zip(completions, answer)]

rows = json.loads(open(sys.argv[1]).read())
result = grpo_cli.train(
    ["reward=[accuracy]", "trainer.max_steps=%d" % int(sys.argv[3]), "sampler.max_new_tokens=32"],
    rewards={"exact": exact},
    train_rows=rows[100:],
    eval_rows=rows[:100],
    run_dir=sys.argv[2],
)
print("result:", result.run_dir, result.checkpoint, result.metrics.get("eval/accuracy"))
"""


def python(steps: int) -> dict:
    folder = OUT / "python"
    run_dir = folder / "run"
    if not (run_dir / "metrics.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rows.json").write_text(json.dumps(qa_rows(seed=1)))
        (folder / "child.py").write_text(textwrap.dedent(CHILD))
        harness.run([sys.executable, "child.py", "rows.json", str(run_dir), str(steps)], cwd=folder)
    return {
        "command": "grpo_cli.train(['reward=[accuracy]', ...], rewards={'exact': exact}, train_rows=..., eval_rows=...)",
        **_before_after(run_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("journeys", nargs="*", default=list(JOURNEYS), choices=JOURNEYS)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs first")
    args = parser.parse_args()
    if args.fresh:
        shutil.rmtree(OUT, ignore_errors=True)
    rows = []
    for name in args.journeys:
        row = {"journey": name, **globals()[name](args.steps)}
        rows.append(row)
        print(
            f"{name:14s} {row['steps']:>3} steps  held-out {row['before']:.3f} -> {row['after']:.3f}  {row['per_group']}"
        )
    # (the journeys not run now keep their rows from an earlier invocation)
    kept = json.loads(RESULT.read_text())["rows"] if RESULT.exists() else []
    kept = [r for r in kept if r["journey"] not in args.journeys]
    print(f"wrote {harness.write_result('first_day', kept + rows, path=RESULT)}")


if __name__ == "__main__":
    main()
