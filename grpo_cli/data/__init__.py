"""Prompts: where the rows come from (data sources, one plug-in each), formatting, length
filtering, and a seeded, resumable prompt stream.

A data source is a plug-in (grpo_cli/plugins.py): a module declaring `PLUGIN = Plugin(...)`,
chosen by data.source (a module of this package by its file name, or a user's by import path,
data.source=my_pkg.my_data) with a preset in conf/data/:

    arithmetic   the built-in generator (data/arithmetic.py)
    file         a local json/jsonl/csv/parquet file (data/file.py)
    hub          a Hugging Face hub dataset (data/hub.py)
    reasoning_gym  reasoning-gym's procedural tasks (data/reasoning_gym.py, an optional extra)

What this package asks of it: build(d, seed, options) -> (training rows, held-out rows), read
and checked without a tokenizer (d: the data section; options: its own, from data.options, an
instance of its options dataclass or None); check(d) -> problems; facts: Facts.

Every column other than the prompt column reaches the reward functions as a keyword argument.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_cli import plugins
from grpo_cli.chat_template import render
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin

# What to do with a prompt longer than sampler.max_prompt_length.
LONG_PROMPT_RULES = ("drop", "truncate_left", "error")


@dataclass(frozen=True)
class Facts:
    """What a data source declares: wide_eval(d, seed) -> rows of a second held-out set (None:
    it has none); and the defaults its task needs, used where the user set none
    (grpo_cli/config/task.py): max_new_tokens, the completion length its answers need (256:
    a few paragraphs of reasoning, TRL's max_completion_length until 1.9 (1.16's is 512); a task
    whose answers are short says so), and rewards,
    the rewards that score it, its correctness reward first; demonstration(columns) -> the
    completion that answers a row (its columns besides the prompt) in the form its correctness
    reward checks, or None where it has none: what sft=demonstrations trains on (grpo_cli/sft.py;
    None: the source writes none, give sft.path); validation(d, seed) -> data.val_size rows of
    problems it neither trains on nor holds out (None: they are carved from the training rows)."""

    wide_eval: Callable[[Any, int], list[dict]] | None = None
    max_new_tokens: int = 256
    rewards: tuple[str, ...] = ("accuracy",)
    demonstration: Callable[[dict], str | None] | None = None
    validation: Callable[[Any, int], list[dict]] | None = None


def completion_column(columns: dict) -> str | None:
    """A table's demonstration: its `completion` column (TRL's prompt-completion format), where
    it is a non-empty string."""
    value = columns.get("completion")
    return value if isinstance(value, str) and value.strip() else None


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


@dataclass(frozen=True)
class Formatting:
    """How rows become token ids: the prompt column, the system prompt, the chat template's use,
    the length limit (sampler.max_prompt_length) and the rule for longer prompts."""

    prompt_column: str = "prompt"
    system_prompt: str | None = None
    use_chat_template: bool = True
    max_prompt_length: int = 256
    long_prompts: str = "drop"
    # The prompt of a row without one (no prompt column, or an empty prompt), where an environment
    # owns the task (environment.style=trl: TRL's empty user message, which reset's text then
    # fills); None: such a row is refused.
    missing_prompt: Any = None

    @classmethod
    def of(cls, d, max_prompt_length: int) -> Formatting:
        """The formatting the data section `d` asks for."""
        return cls(d.prompt_column, d.system_prompt, d.use_chat_template, max_prompt_length, d.long_prompts)


def plugin(name: str) -> Plugin:
    """The declaration of data source `name` (a module of this package, or a user's import path)."""
    return plugins.load(__name__, name, "data.source")


def check_data(d) -> list[str]:
    """The data group's problems (config validation): the source's name and options, then its
    own checks."""
    try:
        chosen = plugin(d.source)
        plugins.read_options(chosen, d.options, "data.options")
    except UserError as exc:
        return [str(exc)]
    return chosen.problems(d)


def read_rows(d, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the data section `d`, read and checked without a
    tokenizer, so bad data fails before any model is loaded."""
    chosen = plugin(d.source)
    return chosen.build(d, seed, plugins.read_options(chosen, d.options, "data.options"))


def wide_eval_rows(d, seed: int) -> list[dict]:
    """The source's second held-out set (its facts.wide_eval), or []."""
    wide = plugin(d.source).facts.wide_eval
    return wide(d, seed) if wide is not None else []


def check_prompt_column(rows: list[dict], prompt_column: str, where: str, missing_ok: bool = False) -> None:
    """Every row has a prompt: a non-empty string or a list of {role, content} messages (missing_ok:
    or none at all, where the environment writes the task: Formatting.missing_prompt)."""
    if missing_ok:
        rows = [row for row in rows if row.get(prompt_column) not in (None, "", [])]
    elif rows and not any(prompt_column in row for row in rows):
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
    config allows; rendered with the keyword arguments the tokenizer carries,
    model.chat_template_kwargs: chat_template.render), else the plain prompt. tools: JSON schemas
    the template renders (an environment's native tool protocol)."""
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
        return render(tokenizer, messages, tools=tools)
    return f"{system_prompt}\n\n{prompt}" if system_prompt else str(prompt)


def _to_examples(rows: list[dict], tokenizer, f: Formatting, where: str) -> tuple[list[Example], int, int]:
    check_prompt_column(rows, f.prompt_column, where, missing_ok=f.missing_prompt is not None)
    examples, dropped, truncated = [], 0, 0
    templated_text = f.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    for row in rows:
        prompt = row.get(f.prompt_column)
        if prompt in (None, "", []):  # (only where missing_prompt is set: check_prompt_column)
            prompt = f.missing_prompt
        text = format_prompt(
            prompt, tokenizer, system_prompt=f.system_prompt, use_chat_template=f.use_chat_template
        )
        # A chat template already holds the special tokens the model expects.
        templated = isinstance(prompt, list) or templated_text
        ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if len(ids) > f.max_prompt_length:
            if f.long_prompts == "drop":
                dropped += 1
                continue
            if f.long_prompts == "error":
                raise UserError(
                    f"a prompt in {where} has {len(ids)} tokens, over "
                    f"sampler.max_prompt_length={f.max_prompt_length}: {str(prompt)[:80]!r}. "
                    "Raise the limit or set data.long_prompts=drop."
                )
            ids = ids[-f.max_prompt_length :]  # truncate_left: keep the end, where the question is
            truncated += 1
        columns = {k: v for k, v in row.items() if k != f.prompt_column}
        examples.append(Example(prompt=prompt, prompt_ids=ids, columns=columns))
    return examples, dropped, truncated


def validation_rows(d, rows: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows) for trainer.best_metric, never trained on, apart from the
    held-out set: data.val_size rows the source draws apart (its facts.validation: the training
    rows unchanged), else drawn by `seed` from the training rows (the rest keep their order).
    data.val_size 0: none."""
    size = d.val_size
    if size <= 0:
        return rows, []
    apart = plugin(d.source).facts.validation
    if apart is not None:
        return rows, apart(d, seed)
    if size >= len(rows):
        raise UserError(
            f"data.val_size={size} takes every training row ({len(rows)}): carve fewer (e.g. {max(1, len(rows) // 10)}), "
            "or give more data (data.num_examples for the built-in arithmetic)."
        )
    import random

    picked = sorted(random.Random(seed + 1).sample(range(len(rows)), size))
    chosen = set(picked)
    return [row for i, row in enumerate(rows) if i not in chosen], [rows[i] for i in picked]


def to_examples(rows: list[dict], tokenizer, f: Formatting, where: str) -> list[Example]:
    """Rows formatted and tokenized as the held-out split is (a second held-out set)."""
    examples, _, _ = _to_examples(rows, tokenizer, f, where)
    return examples


def build_prompts(rows: tuple[list[dict], list[dict]], tokenizer, f: Formatting, where: str) -> PromptData:
    """Format and tokenize (training rows, held-out rows); apply the long-prompt rule. where: the
    data, as errors name it."""
    train, d1, t1 = _to_examples(rows[0], tokenizer, f, where)
    evals, d2, t2 = _to_examples(rows[1], tokenizer, f, "the eval split")
    if not train:
        raise UserError(
            f"every training prompt is longer than sampler.max_prompt_length={f.max_prompt_length} "
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
