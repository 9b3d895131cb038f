"""Prompts: the built-in arithmetic generator, local files and hub datasets; formatting,
length filtering, the held-out split, and a seeded, resumable prompt stream.

Every column other than the prompt column reaches the reward functions as a keyword argument.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError

SOURCES = ("arithmetic", "file", "hub")
# What to do with a prompt longer than sampler.max_prompt_length.
LONG_PROMPT_RULES = ("drop", "truncate_left", "error")
OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class Example:
    prompt: Any  # as in the dataset: a string or a list of chat messages
    prompt_ids: list[int]
    columns: dict[str, Any]  # every other column (answer, ...)


@dataclass
class PromptData:
    train: list[Example]
    eval: list[Example]
    dropped: int = 0  # prompts over max_prompt_length removed by the `drop` rule
    truncated: int = 0


# ----------------------------------------------------------------------------- raw rows


def arithmetic_space(max_operand: int, max_multiplier: int, operations: list[str]) -> int | None:
    """How many distinct problems the generator can make (None for unknown operations)."""
    if not operations or any(op not in OP_WORDS for op in operations):
        return None
    return sum(
        (max_operand + 1) * ((max_multiplier if op == "*" else max_operand) + 1) for op in set(operations)
    )


def wide_space(max_operand: int, wide_max_operand: int, max_multiplier: int, operations: list[str]) -> int:
    """How many distinct problems arithmetic_wide_rows can make."""
    ops = set(operations) & set(OP_WORDS)
    outside = max(0, wide_max_operand - max_operand)
    pair = (wide_max_operand + 1) ** 2 - (max_operand + 1) ** 2 if outside else 0
    return sum(outside * (max_multiplier + 1) if op == "*" else pair for op in ops)


def check_data(d) -> list[str]:
    """The data group's values (config validation): a dataset's path, and an arithmetic generator
    that can make as many distinct problems as asked for."""
    problems = []
    if d.source in ("file", "hub") and not d.path:
        problems.append(
            f"data.source={d.source} needs data.path (a local json/jsonl/csv/parquet file "
            "or a hub dataset name)."
        )
    if d.source == "arithmetic" and d.max_operand >= 1 and d.max_multiplier >= 0:
        problems += _arithmetic_space_problems(d)
    return problems


def _arithmetic_space_problems(d) -> list[str]:
    problems = []
    space = arithmetic_space(d.max_operand, d.max_multiplier, list(d.operations))
    if space is not None and d.num_examples + d.eval_size > space:
        problems.append(
            f"data.num_examples + data.eval_size = {d.num_examples + d.eval_size} exceeds the {space} "
            f"distinct problems that data.max_operand={d.max_operand}, data.max_multiplier="
            f"{d.max_multiplier} and data.operations allow; raise max_operand or ask for fewer examples."
        )
    wide = d.wide_eval_max_operand
    wide_problems = wide_space(d.max_operand, wide, d.max_multiplier, list(d.operations))
    if wide > d.max_operand and d.eval_size > wide_problems:
        problems.append(
            f"data.eval_size={d.eval_size} exceeds the {wide_problems} distinct problems "
            f"with an operand in {d.max_operand + 1}..{wide} (data.wide_eval_max_operand); raise "
            "data.wide_eval_max_operand or lower data.eval_size."
        )
    return problems


def arithmetic_rows(
    num_examples: int,
    eval_size: int,
    *,
    max_operand: int,
    max_multiplier: int,
    operations: list[str],
    seed: int,
) -> tuple[list[dict], list[dict]]:
    """Unique "What is a plus b?" problems; the eval rows never appear in the training rows."""
    bad = [op for op in operations if op not in OP_WORDS]
    if bad or not operations:
        raise UserError(
            f"data.operations={list(operations)} must be a non-empty list drawn from {list(OP_WORDS)}."
        )
    rng = random.Random(seed)
    space = arithmetic_space(max_operand, max_multiplier, list(operations))
    want = num_examples + eval_size
    if want > space:
        raise UserError(
            f"data.num_examples + data.eval_size = {want} exceeds the {space} distinct "
            "problems these operands allow; raise data.max_operand or ask for fewer."
        )
    seen: set[tuple] = set()
    rows = []
    while len(rows) < want:
        op = rng.choice(list(operations))
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_multiplier if op == "*" else max_operand)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append(_arithmetic_row(a, op, b))
    return rows[eval_size:], rows[:eval_size]


def _arithmetic_row(a: int, op: str, b: int) -> dict:
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    # `kind` lets the evaluation report accuracy per kind of problem (data.eval_group_by): the
    # operation, with a subtraction whose result is below zero apart (minus_negative), the kind
    # the default model almost never samples a right answer for (docs/recipe.md).
    return {
        "prompt": f"What is {a} {OP_WORDS[op]} {b}? Answer with only the number.",
        "answer": str(answer),
        "operation": OP_WORDS[op],
        "kind": "minus_negative" if answer < 0 else OP_WORDS[op],
    }


def arithmetic_wide_rows(
    size: int,
    *,
    max_operand: int,
    wide_max_operand: int,
    max_multiplier: int,
    operations: list[str],
    seed: int,
) -> list[dict]:
    """A second held-out set: `size` problems with an operand above the training range (up to
    wide_max_operand), so none can appear in training. plus/minus: both operands up to
    wide_max_operand, at least one above max_operand; times: the first operand above max_operand,
    the multiplier in its training range. Shows whether the model learned arithmetic or the
    training range's answers."""
    if wide_max_operand <= max_operand or size <= 0:
        return []
    space = wide_space(max_operand, wide_max_operand, max_multiplier, list(operations))
    if size > space:
        raise UserError(
            f"data.eval_size={size} exceeds the {space} distinct problems with an operand in "
            f"{max_operand + 1}..{wide_max_operand}; raise data.wide_eval_max_operand or lower data.eval_size."
        )
    rng = random.Random(seed * 7919 + 1)  # its own stream: the training draw is unchanged
    seen: set[tuple] = set()
    rows = []
    ops = list(operations)
    while len(rows) < size:
        op = rng.choice(ops)
        if op == "*":
            a, b = rng.randint(max_operand + 1, wide_max_operand), rng.randint(0, max_multiplier)
        else:
            a, b = rng.randint(0, wide_max_operand), rng.randint(0, wide_max_operand)
            if max(a, b) <= max_operand:
                continue
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append(_arithmetic_row(a, op, b))
    return rows


def _load_table(path: str, subset: str | None, split: str, source: str) -> list[dict]:
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


def check_prompt_column(rows: list[dict], prompt_column: str, where: str) -> None:
    """Every row has a prompt: a non-empty string or a list of {role, content} messages."""
    if rows and not any(prompt_column in row for row in rows):
        raise UserError(
            f"{where} has no column {prompt_column!r} (columns: {', '.join(map(str, rows[0]))}); "
            f"set data.prompt_column to the column that holds the prompts."
        )
    for i, row in enumerate(rows, start=1):
        prompt = row.get(prompt_column)
        if isinstance(prompt, str) and prompt.strip():
            continue
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
        ):
            continue
        raise UserError(
            f"{where}: record {i} has no usable {prompt_column!r} (got {str(prompt)[:60]!r}); each "
            'prompt must be a non-empty string or a list of {"role": ..., "content": ...} '
            "messages. Fix or remove that record."
        )


# ----------------------------------------------------------------------------- formatting


def format_prompt(
    prompt: Any, tokenizer, *, system_prompt: str | None, use_chat_template: bool, tools: list | None = None
) -> str:
    """The text the model continues: the chat template when the tokenizer has one (and the
    config allows), else the plain prompt. tools: JSON schemas the template renders (an
    environment's native tool protocol)."""
    is_chat = isinstance(prompt, list)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if is_chat and not has_template:
        raise UserError(
            "the dataset's prompts are chat messages but the tokenizer has no chat "
            "template; set model.chat_template to a Jinja template, or give plain-text prompts."
        )
    if is_chat or (use_chat_template and has_template):
        messages = list(prompt) if is_chat else [{"role": "user", "content": str(prompt)}]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}] + messages
        if tools:
            return tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\n{prompt}" if system_prompt else str(prompt)


def _to_examples(
    rows: list[dict],
    tokenizer,
    *,
    prompt_column: str,
    system_prompt: str | None,
    use_chat_template: bool,
    max_prompt_length: int,
    long_prompts: str,
    where: str,
) -> tuple[list[Example], int, int]:
    check_prompt_column(rows, prompt_column, where)
    examples, dropped, truncated = [], 0, 0
    for row in rows:
        text = format_prompt(
            row[prompt_column], tokenizer, system_prompt=system_prompt, use_chat_template=use_chat_template
        )
        # A chat template already holds the special tokens the model expects.
        templated = isinstance(row[prompt_column], list) or (
            use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        )
        ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if len(ids) > max_prompt_length:
            if long_prompts == "drop":
                dropped += 1
                continue
            if long_prompts == "error":
                raise UserError(
                    f"a prompt in {where} has {len(ids)} tokens, over "
                    f"sampler.max_prompt_length={max_prompt_length}: {str(row[prompt_column])[:80]!r}. "
                    "Raise the limit or set data.long_prompts=drop."
                )
            ids = ids[-max_prompt_length:]  # truncate_left: keep the end, where the question is
            truncated += 1
        columns = {k: v for k, v in row.items() if k != prompt_column}
        examples.append(Example(prompt=row[prompt_column], prompt_ids=ids, columns=columns))
    return examples, dropped, truncated


def to_examples(rows: list[dict], tokenizer, *, where: str, **formatting) -> list[Example]:
    """Rows formatted and tokenized as the held-out split is (a second held-out set)."""
    examples, _, _ = _to_examples(rows, tokenizer, where=where, **formatting)
    return examples


def read_rows(
    *,
    source: str,
    path: str | None,
    subset: str | None,
    split: str,
    eval_split: str | None,
    eval_size: int,
    prompt_column: str,
    num_examples: int,
    max_operand: int,
    max_multiplier: int,
    operations: list[str],
    seed: int,
) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows), read and checked without a tokenizer, so bad data fails
    before any model is loaded."""
    if source == "arithmetic":
        return arithmetic_rows(
            num_examples,
            eval_size,
            max_operand=max_operand,
            max_multiplier=max_multiplier,
            operations=list(operations),
            seed=seed,
        )
    rows = _load_table(path, subset, split, source)
    if not rows:
        raise UserError(f"data.path={path!r} holds no rows; give a dataset with at least one prompt.")
    where = f"data.path={path!r}"
    check_prompt_column(rows, prompt_column, where)
    if eval_split:
        eval_rows = _load_table(path, subset, eval_split, source)
        check_prompt_column(eval_rows, prompt_column, f"{where} split {eval_split!r}")
        return _fill_columns(rows), _fill_columns(eval_rows)
    shuffled = rows[:]
    random.Random(seed).shuffle(shuffled)
    n_eval = min(eval_size, len(shuffled) // 5)  # never more than a fifth of the data
    shuffled = _fill_columns(shuffled)
    return shuffled[n_eval:], shuffled[:n_eval]


def _fill_columns(rows: list[dict]) -> list[dict]:
    """Rows with optional fields (JSON Lines): every row gets every column, None where absent,
    so a batch's columns line up with its completions."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return [{name: row.get(name) for name in names} for row in rows]


def build_prompts(
    train_rows: list[dict],
    eval_rows: list[dict],
    *,
    tokenizer,
    source: str,
    path: str | None,
    prompt_column: str,
    system_prompt: str | None,
    use_chat_template: bool,
    long_prompts: str,
    max_prompt_length: int,
) -> PromptData:
    """Format and tokenize the rows; apply the long-prompt rule."""
    kw = dict(
        prompt_column=prompt_column,
        system_prompt=system_prompt,
        use_chat_template=use_chat_template,
        max_prompt_length=max_prompt_length,
        long_prompts=long_prompts,
    )
    train, d1, t1 = _to_examples(train_rows, tokenizer, where=f"data ({source} {path or ''})".strip(), **kw)
    evals, d2, t2 = _to_examples(eval_rows, tokenizer, where="the eval split", **kw)
    if not train:
        raise UserError(
            f"every training prompt is longer than sampler.max_prompt_length={max_prompt_length} "
            f"tokens ({d1} dropped); raise sampler.max_prompt_length or shorten the prompts."
        )
    return PromptData(train=train, eval=evals, dropped=d1 + d2, truncated=t1 + t2)


# ----------------------------------------------------------------------------- prompt stream


@dataclass
class PromptStream:
    """Seeded, epoch-aware stream of training examples; its state is two ints, so a resumed run
    continues with exactly the prompts an uninterrupted run would have seen."""

    examples: list[Example]
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _ensure_order(self) -> None:
        if not self._order:
            self._order = list(range(len(self.examples)))
            random.Random(self.seed * 100003 + self.epoch).shuffle(self._order)

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            self._ensure_order()
            if self.position >= len(self._order):
                self.epoch, self.position, self._order = self.epoch + 1, 0, []
                continue
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), []
