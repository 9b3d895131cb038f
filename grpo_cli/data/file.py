"""A local file (data.source=file, the jsonl preset): JSON Lines, a JSON array, csv or parquet,
read whole; data.eval_size of its rows held out."""

from __future__ import annotations

from grpo_cli.data import Facts, completion_column
from grpo_cli.data._tables import needs_path, table_rows
from grpo_cli.plugins import Plugin

PLUGIN = Plugin(
    name="file",
    build=lambda d, seed, options: table_rows(d, seed, "file"),
    check=needs_path,
    facts=Facts(demonstration=completion_column),
)
