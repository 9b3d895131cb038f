"""A Hugging Face hub dataset (data.source=hub, the gsm8k preset): data.path names it,
data.subset its configuration, data.split and data.eval_split its splits (the datasets package)."""

from __future__ import annotations

from grpo_cli.data import Facts, completion_column
from grpo_cli.data._tables import needs_path, table_rows
from grpo_cli.plugins import Plugin

PLUGIN = Plugin(
    name="hub",
    build=lambda d, seed, options: table_rows(d, seed, "hub"),
    check=needs_path,
    facts=Facts(demonstration=completion_column),
)
