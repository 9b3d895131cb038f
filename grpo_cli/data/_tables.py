"""Rows of a table (a local file or a hub dataset), shared by the file and hub sources: loading,
JSON Lines with line numbers in their errors, the held-out split, columns filled in."""

from __future__ import annotations

import random
from pathlib import Path

from grpo_cli.errors import UserError

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def table_rows(d, seed: int, source: str) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the table data.path names: its eval split when
    data.eval_split is set, else data.eval_size shuffled rows held out (at most a fifth)."""
    rows = load_table(d.path, d.subset, d.split, source)
    if not rows:
        raise UserError(f"data.path={d.path!r} holds no rows; give a dataset with at least one prompt.")
    # (The prompt column is checked where rows become examples, data.build_prompts: an environment
    # of TRL's style may own the task, and rows without a prompt are then fine.)
    if d.eval_split:
        eval_rows = load_table(d.path, d.subset, d.eval_split, source)
        return fill_columns(rows), fill_columns(eval_rows)
    return held_out(rows, d.eval_size, seed)


def held_out(rows: list[dict], eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): `eval_size` rows drawn by `seed` held out, never more than
    a fifth of them (so a small table keeps most rows to train on); every row given every column."""
    shuffled = rows[:]
    random.Random(seed).shuffle(shuffled)
    n_eval = min(eval_size, len(shuffled) // 5)
    shuffled = fill_columns(shuffled)
    return shuffled[n_eval:], shuffled[:n_eval]


def needs_path(d) -> list[str]:
    """A table source's check: data.path is set."""
    if d.path:
        return []
    return [
        f"data.source={d.source} needs data.path (a local json/jsonl/csv/parquet file or a hub dataset name)."
    ]


def load_table(path: str, subset: str | None, split: str, source: str) -> list[dict]:
    try:
        if source == "file":
            file = Path(path).expanduser()
            fmt = FILE_FORMATS.get(file.suffix.lower())
            if fmt is None:
                raise UserError(
                    f"data.path={path!r}: unknown file type {file.suffix!r}; use one of "
                    f"{', '.join(FILE_FORMATS)}."
                )
            if not file.is_file():
                what = "is a folder, not a file" if file.is_dir() else "does not exist"
                raise UserError(
                    f"data.path={path!r} {what} (looked in {file.resolve()}). "
                    "Give the path of a json/jsonl/csv/parquet file."
                )
            if fmt == "json":
                return _read_json_lines(file)
            datasets = _datasets()
            ds = datasets.load_dataset(fmt, data_files=str(file), split="train")
        else:
            datasets = _datasets()
            ds = datasets.load_dataset(path, subset, split=split)
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types for unreachable/malformed sources
        raise UserError(
            f"could not load data.path={path!r} ({source}, split {split!r}): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}. If the hub is unreachable, "
            "download the dataset elsewhere, save it as jsonl and use data=jsonl data.path=FILE."
        ) from exc
    return [dict(row) for row in ds]


def _datasets():
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _read_json_lines(file: Path) -> list[dict]:
    """JSON Lines (or a JSON array), reporting the line number of a malformed line."""
    import json

    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"data.path={str(file)!r} is not UTF-8 text (byte {exc.start}); give a JSON Lines "
            "file, or a csv/parquet file with the matching extension."
        ) from exc
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"data.path={str(file)!r}: invalid JSON at line {exc.lineno}: {exc.msg}."
            ) from exc
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"data.path={str(file)!r}: line {lineno} is not valid JSON "
                    f"({exc.msg}): {line[:80]!r}. Fix or remove that line."
                ) from exc
    if not isinstance(rows, list):
        raise UserError(
            f"data.path={str(file)!r}: expected JSON Lines (one object per line) or a JSON array."
        )
    for i, r in enumerate(rows, start=1):
        if not isinstance(r, dict):
            raise UserError(
                f"data.path={str(file)!r}: record {i} is {type(r).__name__} {str(r)[:60]!r}, not a "
                "JSON object; every record must be an object with a prompt field."
            )
    return rows


def fill_columns(rows: list[dict]) -> list[dict]:
    """Rows with optional fields (JSON Lines): every row gets every column, None where absent,
    so a batch's columns line up with its completions."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return [{name: row.get(name) for name in names} for row in rows]
