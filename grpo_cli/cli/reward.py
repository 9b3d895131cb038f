"""`grpo-reward-test`: run the configured rewards on a few completions and print a table, to
check a reward before spending compute on training.

    grpo-reward-test 'reward=[accuracy,format]' -c "47" -c "47 or 48" --column answer=47
    grpo-reward-test 'reward=[accuracy]' --file cases.jsonl     # {"completion": ..., "answer": ...}
    grpo-reward-test +reward.mine.fn=my_pkg:reward --chat -c "47"  # a reward written for TRL's chat format
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from grpo_cli.cli.common import compose_config
from grpo_cli.errors import UserError, report_and_exit


def _parse_columns(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"--column {pair!r} must look like NAME=VALUE, e.g. --column answer=47.")
        key, value = pair.split("=", 1)
        out[key] = value
    return out


def _read_cases(path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise UserError(
            f"--file {path!r} does not exist; give a JSON Lines file with a "
            "`completion` field per line (other fields become dataset columns)."
        )
    cases = []
    for lineno, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"--file {path!r}: line {lineno} is not valid JSON ({exc.msg}).") from exc
        if not isinstance(case, dict) or "completion" not in case:
            raise UserError(f"--file {path!r}: line {lineno} needs a `completion` field.")
        cases.append(case)
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-reward-test", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. 'reward=[accuracy,format]'")
    parser.add_argument(
        "-c", "--completion", action="append", default=[], help="a completion to score (repeatable)"
    )
    parser.add_argument(
        "--column",
        action="append",
        default=[],
        help="a dataset column for every completion, NAME=VALUE (repeatable)",
    )
    parser.add_argument(
        "--file",
        help='JSON Lines: one {"completion": ..., <columns>...} per line; a completion may be a list of '
        'messages (an episode: assistant, tool, user), with its "env_reward"',
    )
    parser.add_argument("--prompt", default="", help="the prompt passed to the rewards")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="score as for a dataset of chat prompts: each completion reaches the rewards as "
        '[{"role": "assistant", "content": ...}] and the prompt as [{"role": "user", ...}] (TRL\'s convention)',
    )
    parser.add_argument("--tokenizer", help="model folder, hub id or builtin:tiny, for token-based rewards")
    parser.add_argument("--config-dir", help="a folder of your own config groups (as grpo-train's)")
    args = parser.parse_args(argv)
    try:
        from grpo_cli.rewards import as_reward_input, build_rewards, score_rewards

        cases = [{"completion": c} for c in args.completion]
        if args.file:
            cases += _read_cases(args.file)
        if not cases:
            raise UserError("no completions given; pass -c TEXT (repeatable) or --file cases.jsonl.")
        shared = _parse_columns(args.column)
        rows = [{**shared, **case} for case in cases]
        # An episode replayed: `completion` a list of messages, `env_reward` the environment's reward.
        keys = sorted({k for row in rows for k in row} - {"completion", "env_reward"})
        missing = [k for k in keys if any(k not in row for row in rows)]
        if missing:
            raise UserError(
                f"columns {missing} are set for some completions but not all; give them "
                "on every line or with --column."
            )
        reward_cfg = compose_config(args.overrides, config_dir=args.config_dir, check=False).reward
        specs = build_rewards(OmegaConf.to_container(reward_cfg, resolve=True))
        completions = [row["completion"] for row in rows]
        completion_ids = None
        if args.tokenizer:
            from grpo_cli.models import load_tokenizer, resolve_source

            tok = load_tokenizer(resolve_source(args.tokenizer))
            completion_ids = [
                tok(c if isinstance(c, str) else str(c), add_special_tokens=False)["input_ids"]
                for c in completions
            ]
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        stats: dict[str, float] = {}
        with specs.open():  # (a reward with a build, e.g. a model, loads here and is freed after)
            totals, per_reward = score_rewards(
                specs,
                [as_reward_input(prompt, c) if isinstance(c, str) else c for c in completions],
                prompts=[prompt] * len(rows),
                completion_ids=completion_ids,
                columns={k: [row[k] for row in rows] for k in keys},
                env_reward=[row.get("env_reward") for row in rows]
                if any("env_reward" in r for r in rows)
                else None,
                stats=stats,
            )
    except UserError as exc:
        report_and_exit("grpo-reward-test", [str(exc)])
    table = Table(title="rewards", header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("completion", overflow="fold", max_width=48)
    for key in keys:
        table.add_column(key)
    for spec in specs:
        table.add_column(f"{spec.name} (x{spec.weight:g})", justify="right")
    table.add_column("total", justify="right", style="bold")
    for i, row in enumerate(rows):
        values = ["None" if per_reward[s.name][i] is None else f"{per_reward[s.name][i]:.4g}" for s in specs]
        c = row["completion"]
        shown = (  # an episode: every message with who wrote it, as training logs it
            " ".join(f"[{m.get('role')}] {m.get('content')}" for m in c)
            if isinstance(c, list) and all(isinstance(m, dict) for m in c)
            else repr(c)
        )
        table.add_row(str(i), shown, *[str(row[k]) for k in keys], *values, f"{totals[i]:.4g}")
    Console().print(table)
    # Each reward's time, and its counters (a judge's calls, retries, timeouts; NaN failures).
    print("time: " + ", ".join(f"{s.name} {stats.get(f'time/rewards/{s.name}', 0.0):.3f} s" for s in specs))
    counted = {k: v for k, v in stats.items() if k.startswith("rewards/") and v}
    if counted:
        print("counted: " + ", ".join(f"{k[len('rewards/') :]} {v:g}" for k, v in sorted(counted.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
