#!/usr/bin/env python
"""A TRL environment example and a skyrl-gym environment trained end to end for a few steps on the
default model (issue #48), with the environments' own metrics.

    bash scripts/run.sh python scripts/bench_env_examples.py [--steps 8]

trl: TRL's documented IncrementEnv with an external dataset (tests/trl_doc_environments.py, its
GRPO guide's class, unchanged), environment.style=trl, the tag protocol (SmolLM2's template
renders no tools), 12 rows "Increment the counter to N." (N 1-6, `target` column), the
environment's get_reward as the reward (reward=[environment]).
skyrl_gym: skyrl-gym's own gsm8k environment (environment.style=text_gym environment.fn=gsm8k) on
the default arithmetic task (the row's answer becomes its reward spec), reward=[accuracy,
environment] (an episode cut by the token budget before the env grades it has no environment
reward; accuracy grades it), sampler.max_new_tokens=48 (the trl run: 32).

Both: --steps steps of 4 prompts x 8 episodes, max_turns 2. Per run: the first and last steps'
reward and env/* metrics, and the median step time. Runs go to .bench/env_examples/ (reused when
finished); writes scripts/results/env_examples.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import harness

OUT = harness.ROOT / ".bench" / "env_examples"


def _rows_file() -> str:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "increment.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"Increment the counter to {n}."}], "target": n}
        for n in list(range(1, 7)) * 4
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def arms(steps: int) -> dict[str, list[str]]:
    common = [f"trainer.max_steps={steps}", "environment.max_turns=2"]
    return {
        "trl": [
            "data=jsonl",
            f"data.path={_rows_file()}",
            "data.eval_size=4",
            "environment.style=trl",
            "environment.fn=trl_doc_environments:IncrementEnvFromData",
            "reward=[environment]",
            "sampler.max_new_tokens=32",
            *common,
        ],
        "skyrl_gym": [
            "environment.style=text_gym",
            "environment.fn=gsm8k",
            # (accuracy too: an episode a token budget cuts before the env grades it has no env reward)
            "reward=[accuracy,environment]",
            "sampler.max_new_tokens=48",
            "data.eval_size=20",
            *common,
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    a = parser.parse_args(argv)
    env = {"PYTHONPATH": str(harness.ROOT / "tests")}  # (the TRL classes' module)
    rows = []
    for name, overrides in arms(a.steps).items():
        run = OUT / name
        steps = harness.step_rows(run)
        if len(steps) < a.steps:
            shutil.rmtree(run, ignore_errors=True)
            harness.launch(overrides, run, env=env)
            steps = harness.step_rows(run)
        first, last = steps[0], steps[-1]
        env_keys = sorted(k for k in last if k.startswith("env/"))
        rows.append(
            {
                "run": name,
                "steps": len(steps),
                "reward_first": first["reward"],
                "reward_last": last["reward"],
                "reward_mean": sum(r["reward"] for r in steps) / len(steps),
                "step_time": harness.median(r["step_time"] for r in steps),
                **{f"{k}_first": first[k] for k in env_keys},
                **{f"{k}_last": last[k] for k in env_keys},
            }
        )
        print(f"{name}: reward {first['reward']:.3f} -> {last['reward']:.3f}", flush=True)
    harness.print_table(rows, ["run", "steps", "reward_first", "reward_last", "reward_mean", "step_time"])
    notes = (
        "a few steps end to end on the default model; env/* are per-episode means of the first and last step"
    )
    print(f"wrote {harness.write_result('env_examples', rows, notes=notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
