"""Several local files mixed by weight (data.source=mix, the mix preset; docs/configuration.md):

    grpo-train data=mix 'data.options.sources=[{path: math.jsonl, weight: 3}, {path: words.jsonl}]'

Each source is a file the `file` source reads (JSON Lines, a JSON array, csv, parquet), with a
relative `weight` (default 1.0) and a `name` (default: the file's stem), which every one of its
rows carries in the `source` column: the held-out accuracy is reported per source
(eval_group_by: source). Each source holds out its share of data.eval_size (an equal share, at
most a fifth of its rows). The training rows are drawn up front from the seed: for each of
data.options.size rows (default: every source's training rows together) a source by weight, then
that source's next row in a seeded shuffle (from the start again once it is used up). The same
options and seed give the same rows, so the prompt stream's (epoch, position) resumes exactly.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional  # (List/Optional: OmegaConf-friendly option types)

from grpo_cli import plugins
from grpo_cli.data import Facts, completion_column
from grpo_cli.data._tables import fill_columns, load_table
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin

#: The column that names each row's source.
SOURCE_COLUMN = "source"
_KEYS = ("path", "weight", "name")


@dataclass
class Options:
    """mix's options (data.options.<option>): the one place their defaults live."""

    # Each item: {path, weight (default 1.0), name (default: the file's stem)}, or a path alone.
    sources: List[Any] = field(default_factory=list)
    size: Optional[int] = None  # training rows drawn; None: every source's training rows together


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float = 1.0


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def read_sources(items: Any) -> tuple[list[Source], list[str]]:
    """data.options.sources as Sources, and the problems of its shape (nothing is read)."""
    items = _plain(items)
    how = "each item is a file's path or {path: a.jsonl, weight: 2.0, name: a}"
    if not isinstance(items, list) or not items:
        return [], [f"data.options.sources={items!r} must be a non-empty list: {how}."]
    sources, problems = [], []
    for i, item in enumerate(items):
        where = f"data.options.sources[{i}]"
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, Mapping):
            problems.append(f"{where}={item!r} is neither a path nor a mapping: {how}.")
            continue
        unknown = sorted(set(map(str, item)) - set(_KEYS))
        path, weight = item.get("path"), item.get("weight", 1.0)
        if unknown:
            problems.append(f"{where} has {', '.join(unknown)}; its keys are path, weight and name: {how}.")
        elif not isinstance(path, str) or not path.strip():
            problems.append(f"{where}={item!r} has no path: {how}.")
        elif (
            not isinstance(weight, numbers.Real)
            or isinstance(weight, bool)
            or not (math.isfinite(weight) and weight > 0)
        ):
            problems.append(
                f"{where}.weight={weight!r} ({path}) must be a number > 0 (weights are relative)."
            )
        else:
            sources.append(Source(str(item.get("name") or Path(path).stem), path, float(weight)))
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(
            f"data.options.sources: the name(s) {', '.join(twice)} stand for more than one source; give each "
            "a name of its own (name: ...), which its rows carry in the `source` column."
        )
    return sources, problems


def check(d) -> list[str]:
    """The options' shape (config validation; the files are read when the run starts)."""
    options = plugins.read_options(PLUGIN, _plain(d.options), "data.options")
    _, problems = read_sources(options.sources)
    size = options.size
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        problems.append(f"data.options.size={size!r} must be a whole number >= 1, or null (every row once).")
    if d.path:
        problems.append(
            f"data.path={d.path!r} is not read by data.source=mix, which reads data.options.sources; list the "
            "file there ({path: ..., weight: ...}), or choose data=jsonl for one file."
        )
    return problems


def _source_rows(source: Source) -> list[dict]:
    rows = load_table(source.path, None, "train", "file")
    if not rows:
        raise UserError(
            f"data.options.sources: {source.path!r} ({source.name}) holds no rows; give it some, or drop it."
        )
    if any(SOURCE_COLUMN in row for row in rows):
        raise UserError(
            f"data.options.sources: {source.path!r} already has a {SOURCE_COLUMN!r} column, which the mix "
            "writes (each row's source name); rename that column in the file."
        )
    return [{**row, SOURCE_COLUMN: source.name} for row in rows]


def rows(d, seed: int, options: Options) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): see the module docstring."""
    sources, problems = read_sources(options.sources)
    if problems:
        raise UserError(" ".join(problems))
    rng = random.Random(seed)
    train_parts, held = [], []
    share = int(d.eval_size) // len(sources)
    for source in sources:
        table = _source_rows(source)
        rng.shuffle(table)
        n_eval = min(share, len(table) // 5)
        held += table[:n_eval]
        train_parts.append(table[n_eval:])
    if not any(train_parts):
        raise UserError("data.options.sources: no source has a training row left after the held-out rows.")
    live = [(s, part) for s, part in zip(sources, train_parts) if part]
    size = options.size or sum(len(part) for _, part in live)
    picks = rng.choices(range(len(live)), weights=[s.weight for s, _ in live], k=size)
    cursor = [0] * len(live)
    train = []
    for k in picks:
        part = live[k][1]
        train.append(part[cursor[k] % len(part)])
        cursor[k] += 1
    return fill_columns(train), fill_columns(held)


PLUGIN = Plugin(
    name="mix", build=rows, options=Options, check=check, facts=Facts(demonstration=completion_column)
)
