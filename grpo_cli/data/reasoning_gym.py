"""reasoning-gym's procedural tasks as a data source (data.source=reasoning_gym, the
reasoning_gym preset; docs/reasoning-gym.md).

The rows are drawn up front from the seed by reasoning-gym's own mixing (CompositeDataset: per
row, a seeded draw of a task by weight, then that task's generator), so the same options and seed
give the same rows and the prompt stream's (epoch, position) resumes exactly. Each row:

    prompt    the task's question and a short instruction to end with "Answer: <the answer>"
    answer    the task's answer, a string
    question  the task's question alone (the entry reasoning-gym's scorer reads)
    task      the task's name (data.eval_group_by=task: held-out accuracy per task)
    metadata  the entry's metadata, made JSON-safe (tuples as lists)

The held-out rows (data.eval_size) come from a second draw with their own seed, and a row whose
question is a training row's is skipped, so held-out rows never appear in training.

reasoning-gym is an optional extra (pip install -e '.[reasoning-gym]' in grpo-cli's folder): it is imported only
when this source is used.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, List, Optional  # (List/Optional: OmegaConf-friendly option types)

from grpo_cli import plugins
from grpo_cli.data import Facts
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin

#: What a completion's answer follows (the reasoning_gym reward's `marker` default).
MARKER = "Answer:"
INSTRUCTION = f"Give only the final answer after '{MARKER}'."
#: The preset's tasks: cheap generators with short answers.
DEFAULT_TASKS = ("chain_sum", "leg_counting", "letter_counting", "spell_backward")
#: The held-out seed's distance from the training seed when eval_seed is None.
EVAL_SEED_OFFSET = 1_000_000_007
MISSING_PACKAGE = (
    "data.source=reasoning_gym needs the reasoning-gym package: pip install -e '.[reasoning-gym]' in "
    "grpo-cli's folder"
)
_TASK_KEYS = ("name", "weight", "config")
# A task's generator options that this source sets itself, and the option that sets them.
_OWN_KEYS = {"seed": "data.options.seed", "size": "data.options.size"}


@dataclass
class Options:
    """reasoning_gym's options (data.options.<option>): the one place their defaults live."""

    # Each item: a task's name, or {name, weight (default 1.0), config (the task's own options)}.
    tasks: List[Any] = field(default_factory=lambda: list(DEFAULT_TASKS))
    size: int = 1000  # training rows (the held-out rows: data.eval_size)
    seed: Optional[int] = None  # the training draw's seed; None: the run's (trainer.seed)
    eval_seed: Optional[int] = None  # the held-out draw's; None: the training seed + EVAL_SEED_OFFSET
    instruction: Optional[str] = INSTRUCTION  # appended to each question; null or "": none


@dataclass(frozen=True)
class TaskSpec:
    name: str
    weight: float = 1.0
    config: dict = field(default_factory=dict)


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain dicts and lists."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def read_tasks(tasks: Any) -> tuple[list[TaskSpec], list[str]]:
    """data.options.tasks as TaskSpecs, and the problems of its shape (no import of reasoning_gym)."""
    tasks = _plain(tasks)
    how = "each item is a task's name (chain_sum) or {name: chain_sum, weight: 2.0, config: {min_terms: 2}}"
    if not isinstance(tasks, list) or not tasks:
        return [], [f"data.options.tasks={tasks!r} must be a non-empty list: {how}."]
    specs, problems = [], []
    for i, item in enumerate(tasks):
        where = f"data.options.tasks[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping):
            problems.append(f"{where}={item!r} is neither a task's name nor a mapping: {how}.")
            continue
        unknown = sorted(set(map(str, item)) - set(_TASK_KEYS))
        name, weight, config = item.get("name"), item.get("weight", 1.0), item.get("config") or {}
        if unknown:
            problems.append(f"{where} has {', '.join(unknown)}; its keys are name, weight and config: {how}.")
        elif not isinstance(name, str) or not name.strip():
            problems.append(f"{where}={item!r} has no task name: {how}.")
        elif not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not math.isfinite(weight):
            problems.append(f"{where}.weight={weight!r} ({name}) must be a number > 0, e.g. weight: 1.0.")
        elif weight <= 0:
            problems.append(
                f"{where}.weight={weight} ({name}) must be > 0 (weights are relative: 3 and 1 give about "
                f"three of its rows for one of the other's); to leave the task out, drop it from the list."
            )
        elif not isinstance(config, Mapping):
            problems.append(
                f"{where}.config={config!r} ({name}) must be a mapping of the task's own options, "
                "e.g. config: {min_terms: 2, max_terms: 3}."
            )
        elif set(config) & set(_OWN_KEYS):
            key = sorted(set(config) & set(_OWN_KEYS))[0]
            problems.append(
                f"{where}.config.{key} ({name}) is set by this data source; set {_OWN_KEYS[key]} instead "
                "and drop it from the task's config."
            )
        else:
            specs.append(TaskSpec(name.strip(), float(weight), dict(config)))
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(
            f"data.options.tasks lists {', '.join(twice)} more than once; list each task once (give it a "
            "larger weight for more of its rows)."
        )
    return specs, problems


def _registry() -> dict:
    """reasoning-gym's tasks (name -> (dataset class, config class)); UserError without the package."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:  # (a dependency of the package missing: its own message too)
        ours = str(exc.name or "").startswith("reasoning_gym")
        raise UserError(
            MISSING_PACKAGE if ours else f"{MISSING_PACKAGE} (importing it failed: {exc})"
        ) from exc
    return DATASETS


def task_problems(specs: list[TaskSpec]) -> list[str]:
    """Unknown task names and task configs the task rejects (its config class and validate())."""
    registry = _registry()
    problems = []
    for spec in specs:
        if spec.name not in registry:
            close = difflib.get_close_matches(spec.name, list(registry), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            problems.append(
                f"data.options.tasks: {spec.name!r} is not a reasoning-gym task.{hint} Fix the name; "
                f'the {len(registry)} tasks are listed by: python -c "from reasoning_gym.factory import '
                'DATASETS; print(sorted(DATASETS))"'
            )
            continue
        problem = _config_problem(spec, registry[spec.name][1])
        if problem:
            problems.append(problem)
    return problems


def _config_problem(spec: TaskSpec, config_cls: type) -> str | None:
    known = sorted(f.name for f in fields(config_cls) if f.name not in _OWN_KEYS)
    unknown = sorted(set(map(str, spec.config)) - set(known))
    if unknown:
        return (
            f"data.options.tasks: {spec.name}'s config has {', '.join(unknown)}, which {spec.name} does not "
            f"read; its options are {', '.join(known)} (reasoning-gym's {config_cls.__name__})."
        )
    try:
        config = config_cls(**spec.config)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as exc:  # noqa: BLE001 - the task's own checks (asserts, ValueErrors)
        return (
            f"data.options.tasks: {spec.name} rejects config {spec.config} ({type(exc).__name__}: "
            f"{str(exc) or 'its validate() failed'}); change the values to ones reasoning-gym's "
            f"{config_cls.__name__} allows."
        )
    return None


def check(d) -> list[str]:
    """The options' shape, the package, the task names and configs (config validation)."""
    options = plugins.read_options(PLUGIN, _plain(d.options), "data.options")
    specs, problems = read_tasks(options.tasks)
    if not _is_int(options.size) or options.size < 1:
        problems.append(f"data.options.size={options.size!r} must be a whole number >= 1 (training rows).")
    for key in ("seed", "eval_seed"):
        value = getattr(options, key)
        if value is not None and (not _is_int(value) or value < 0):
            problems.append(f"data.options.{key}={value!r} must be a whole number >= 0, or null (derived).")
    if options.instruction is not None and not isinstance(options.instruction, str):
        problems.append(f"data.options.instruction={options.instruction!r} must be text, or null for none.")
    try:
        problems += task_problems(specs)
    except UserError as exc:
        return [str(exc)]
    return problems


def json_safe(value: Any) -> Any:
    """`value` with tuples and sets as lists and every other non-JSON value as its text."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((json_safe(v) for v in value), key=repr)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def _composite(specs: list[TaskSpec], size: int, seed: int):
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    datasets = [DatasetSpec(s.name, s.weight, dict(s.config)) for s in specs]
    try:
        return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=datasets))
    except Exception as exc:  # noqa: BLE001 - a task's generator refusing its config
        raise UserError(
            f"data.options.tasks: reasoning-gym could not build the tasks "
            f"{', '.join(s.name for s in specs)} ({type(exc).__name__}: {exc}); fix the task's config."
        ) from exc


def _row(item: dict, instruction: str | None) -> dict:
    question = str(item["question"])
    metadata = json_safe(item.get("metadata") or {})
    prompt = f"{question.rstrip()}\n\n{instruction}" if instruction else question
    return {
        "prompt": prompt,
        "answer": str(item["answer"]),
        "question": question,
        "task": str(metadata.get("source_dataset", "")),
        "metadata": metadata,
    }


def _item(dataset, idx: int) -> dict:
    try:
        return dataset[idx]
    except Exception as exc:  # noqa: BLE001 - a task's generator failing on its config
        raise UserError(
            f"data.options.tasks: reasoning-gym failed to generate row {idx} ({type(exc).__name__}: {exc}); "
            "a task's config may ask for something it cannot make: loosen it, or drop that task."
        ) from exc


def task_rows(
    specs: list[TaskSpec], size: int, eval_size: int, *, seed: int, eval_seed: int, instruction: str | None
) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): `size` rows drawn with `seed`, then `eval_size` rows drawn
    with `eval_seed` whose questions are neither a training row's nor an earlier held-out row's."""
    problems = task_problems(specs)
    if problems:
        raise UserError(" ".join(problems))
    train_set = _composite(specs, size, seed)
    train = [_row(_item(train_set, i), instruction) for i in range(size)]
    held: list[dict] = []
    if eval_size > 0:
        cap = 4 * eval_size + 100  # draws before giving up: the tasks' space is too small
        eval_set = _composite(specs, cap, eval_seed)
        seen = {row["question"] for row in train}
        for i in range(cap):
            row = _row(_item(eval_set, i), instruction)
            if row["question"] not in seen:
                seen.add(row["question"])
                held.append(row)
                if len(held) == eval_size:
                    break
        if len(held) < eval_size:
            raise UserError(
                f"data.eval_size={eval_size}: only {len(held)} of {cap} held-out draws were questions "
                f"not in the {size} training rows; the tasks' configs allow too few distinct questions. "
                "Widen the tasks' configs, or lower data.options.size or data.eval_size."
            )
    return train, held


def rows(d, seed: int, options: Options) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the data section `d` with its options."""
    specs, problems = read_tasks(options.tasks)
    if problems:
        raise UserError(" ".join(problems))
    train_seed = seed if options.seed is None else int(options.seed)
    eval_seed = train_seed + EVAL_SEED_OFFSET if options.eval_seed is None else int(options.eval_seed)
    return task_rows(
        specs,
        int(options.size),
        int(d.eval_size),
        seed=train_seed,
        eval_seed=eval_seed,
        instruction=options.instruction,
    )


PLUGIN = Plugin(
    name="reasoning_gym",
    build=rows,
    options=Options,
    check=check,
    # Each task's own scorer (its answers are words, lists and numbers: not the math accuracy's).
    # A demonstration states the answer where the instruction asks for it (the reward reads the
    # line after the last marker).
    facts=Facts(rewards=("reasoning_gym",), demonstration=lambda columns: f"{MARKER} {columns['answer']}"),
)
