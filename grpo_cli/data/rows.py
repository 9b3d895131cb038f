"""Rows given in memory (data.source=rows): what `grpo_cli.train(train_rows=..., eval_rows=...)`
hands the run, a list of dicts or a `datasets.Dataset` each, read as a file's rows are: every
column but the prompt reaches the rewards. Without eval_rows, data.eval_size of the training rows
are held out (at most a fifth), as for a file.

The rows live in this process (`given`, set by grpo_cli.api for the call's duration), so the source
has nothing to read on the command line: there, data=jsonl reads a file."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_cli.data import Facts, completion_column
from grpo_cli.data._tables import fill_columns, held_out
from grpo_cli.plugins import Plugin


@dataclass
class Given:
    """The rows of the running grpo_cli.train call (None: none given)."""

    train: list[dict] | None = None
    eval: list[dict] | None = None
    names: list[str] = field(default_factory=list)


given = Given()


def rows(d, seed: int, options) -> tuple[list[dict], list[dict]]:
    if given.eval is not None:
        return fill_columns(given.train), fill_columns(given.eval)
    return held_out(given.train, d.eval_size, seed)


def check(d) -> list[str]:
    if given.train:
        return []
    return [
        "data.source=rows reads the rows given to grpo_cli.train(train_rows=...) in Python, and none "
        "were given (or the list is empty); pass train_rows, or on the command line read a file with "
        "data=jsonl data.path=FILE."
    ]


PLUGIN = Plugin(name="rows", build=rows, check=check, facts=Facts(demonstration=completion_column))
