"""What the model wrote: each step's sampled completions as records for `completions.jsonl` in the
run folder, the console's compact samples table, and reading them back (`grpo-report --samples`).

A record is one completion of the rollout a step trained on (dynamic sampling: the groups it
kept), with its prompt as the dataset gave it, each reward's value, the weighted total, the
advantage, its length in tokens, whether it was truncated (no EOS within sampler.max_new_tokens)
and whether its group was zero-std (no learning signal). The file keeps texts whole; the console
shortens them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

SAMPLES_FILE = "completions.jsonl"
CONSOLE_CHARS = 40  # a shortened text on the console: the start, then "…"


@dataclass(frozen=True)
class Completions:
    """A step's completions as columns, one entry per completion (rows in rollout order): what
    each record holds besides the step and its group."""

    prompts: list[Any]  # as the dataset gave them
    texts: list[str]
    reward_values: dict[str, list[float | None]]  # each reward's values (None: could not score)
    totals: list[float]  # the weighted total
    advantages: list[float]
    lengths: list[int]  # in tokens
    truncated: list[bool]  # no EOS within sampler.max_new_tokens
    zero_std: list[bool]  # its group had no learning signal
    # Columns rewards logged with TRL's log_extra, one value per completion (a record's "extra").
    extra: dict[str, list] = field(default_factory=dict)


def step_records(step: int, completions: Completions, num_generations: int) -> list[dict[str, Any]]:
    """One record per completion (`num_generations` consecutive rows a group)."""
    c = completions
    return [
        {
            "step": step,
            "group": i // num_generations,
            "prompt": c.prompts[i],
            "completion": c.texts[i],
            "rewards": {name: values[i] for name, values in c.reward_values.items()},
            "reward": c.totals[i],
            "advantage": c.advantages[i],
            "length": c.lengths[i],
            "truncated": c.truncated[i],
            "zero_std": c.zero_std[i],
            **({"extra": {name: values[i] for name, values in c.extra.items()}} if c.extra else {}),
        }
        for i in range(len(c.texts))
    ]


def shorten(text: Any, limit: int = CONSOLE_CHARS) -> str:
    """A text for one console cell: newlines as ⏎, cut to `limit` characters with "…"."""
    if isinstance(text, list):  # chat messages: the last one's content
        text = text[-1].get("content", "") if text and isinstance(text[-1], dict) else str(text)
    flat = str(text).replace("\r", "").replace("\n", "⏎")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def showcase(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The console's row for a step: the group whose rewards differ most (the most informative;
    the first group when every group is zero-std), its best and worst completion side by side."""
    groups: dict[int, list[dict]] = {}
    for record in records:
        groups.setdefault(record["group"], []).append(record)
    if not groups:
        return None
    members = max(groups.values(), key=lambda g: max(r["reward"] for r in g) - min(r["reward"] for r in g))
    best = max(members, key=lambda r: r["reward"])
    worst = min(members, key=lambda r: r["reward"])
    return {"step": records[0]["step"], "prompt": members[0]["prompt"], "best": best, "worst": worst}


def _cell(record: dict[str, Any], limit: int) -> str:
    mark = " (cut)" if record["truncated"] else ""
    return repr(shorten(record["completion"], max(limit - len(mark) - 2, 4))) + mark


def showcase_table(rows: list[dict[str, Any]], width: int = 80) -> Table:
    """The compact table: per logged step, one group's prompt and its best and worst completion
    with their total rewards, one line each in a console `width` characters wide (the texts are
    cut to fit here, so that rich never has to drop a column)."""
    # step, two rewards (4 each) and the 2-space gaps between 6 columns take 22 characters.
    room = max(width - 22, 30)
    prompt_chars, text_chars = room * 3 // 10, room * 7 // 20
    table = Table(title="samples (best and worst of a group)", box=None, pad_edge=False, header_style="bold")
    table.add_column("step", justify="right", no_wrap=True)
    for name in ("prompt", "best", "r", "worst", "r"):
        table.add_column(name, justify="right" if name == "r" else "left", no_wrap=True)
    for row in rows:
        table.add_row(
            str(row["step"]),
            shorten(row["prompt"], prompt_chars),
            _cell(row["best"], text_chars),
            f"{row['best']['reward']:.3g}",
            _cell(row["worst"], text_chars),
            f"{row['worst']['reward']:.3g}",
        )
    return table


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of completions.jsonl; a last line cut short (a run still writing) is skipped."""
    path = run_dir / SAMPLES_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def records_table(records: list[dict[str, Any]], reward_names: list[str], width: int = 60) -> Table:
    """Every record of a step as a table row (grpo-report --samples): group, each reward, total,
    advantage, length, flags, the completion shortened to `width` characters."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("group", *reward_names, "reward", "adv", "len"):
        table.add_column(name, justify="right")
    table.add_column("flags")
    table.add_column("completion", overflow="fold")
    for r in records:
        flags = ",".join(f for f, on in (("cut", r["truncated"]), ("zero-std", r["zero_std"])) if on)
        values = [r["rewards"].get(name) for name in reward_names]
        table.add_row(
            str(r["group"]),
            *["None" if v is None else f"{v:.3g}" for v in values],
            f"{r['reward']:.3g}",
            f"{r['advantage']:+.2f}" if math.isfinite(r["advantage"]) else str(r["advantage"]),
            str(r["length"]),
            flags,
            shorten(r["completion"], width),
        )
    return table
