"""The built-in arithmetic generator (data.source=arithmetic, the default): unique "What is a
plus b?" problems, seeded; the held-out rows never appear in training, and a second, wide
held-out set has an operand above the training range (data.wide_eval_max_operand)."""

from __future__ import annotations

import random

from grpo_cli.data import Facts
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin

OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}


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
    rows = arithmetic_problems(
        num_examples + eval_size,
        max_operand=max_operand,
        max_multiplier=max_multiplier,
        operations=operations,
        seed=seed,
    )
    return rows[eval_size:], rows[:eval_size]


def arithmetic_problems(
    count: int,
    *,
    max_operand: int,
    max_multiplier: int,
    operations: list[str],
    seed: int,
    asked: str = "data.num_examples + data.eval_size",
) -> list[dict]:
    """`count` unique problems drawn by `seed`: a longer draw begins with a shorter one's problems
    (what lets the validation set follow the training and held-out rows without changing them).
    asked: the keys whose sum `count` is, for the error."""
    bad = [op for op in operations if op not in OP_WORDS]
    if bad or not operations:
        raise UserError(
            f"data.operations={list(operations)} must be a non-empty list drawn from {list(OP_WORDS)}."
        )
    rng = random.Random(seed)
    space = arithmetic_space(max_operand, max_multiplier, list(operations))
    if count > space:
        raise UserError(
            f"{asked} = {count} exceeds the {space} distinct "
            "problems these operands allow; raise data.max_operand or ask for fewer."
        )
    seen: set[tuple] = set()
    rows = []
    while len(rows) < count:
        op = rng.choice(list(operations))
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_multiplier if op == "*" else max_operand)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append(_arithmetic_row(a, op, b))
    return rows


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


def check(d) -> list[str]:
    """An arithmetic generator that can make as many distinct problems as asked for."""
    if d.max_operand >= 1 and d.max_multiplier >= 0:
        return _arithmetic_space_problems(d)
    return []


def _arithmetic_space_problems(d) -> list[str]:
    problems = []
    space = arithmetic_space(d.max_operand, d.max_multiplier, list(d.operations))
    asked = d.num_examples + d.eval_size + max(d.val_size, 0)  # (the validation set is drawn apart)
    if space is not None and asked > space:
        problems.append(
            f"data.num_examples + data.eval_size{' + data.val_size' if d.val_size > 0 else ''} = "
            f"{asked} exceeds the {space} "
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


def _drawn(d, seed: int) -> dict:
    """The draw's settings from the data section `d`."""
    return dict(
        max_operand=d.max_operand, max_multiplier=d.max_multiplier, operations=list(d.operations), seed=seed
    )


def rows(d, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the data section `d`."""
    return arithmetic_rows(d.num_examples, d.eval_size, **_drawn(d, seed))


def validation(d, seed: int) -> list[dict]:
    """data.val_size problems drawn after the training and held-out ones, unlike any of them."""
    before = d.num_examples + d.eval_size
    asked = "data.num_examples + data.eval_size + data.val_size"
    return arithmetic_problems(before + d.val_size, asked=asked, **_drawn(d, seed))[before:]


def wide_rows(d, seed: int) -> list[dict]:
    """The wide held-out set's rows (data.wide_eval_max_operand; 0: none)."""
    if not d.wide_eval_max_operand:
        return []
    return arithmetic_wide_rows(
        d.eval_size,
        max_operand=d.max_operand,
        wide_max_operand=d.wide_eval_max_operand,
        max_multiplier=d.max_multiplier,
        operations=list(d.operations),
        seed=seed,
    )


PLUGIN = Plugin(
    name="arithmetic",
    build=lambda d, seed, options: rows(d, seed),
    check=check,
    # Answers are a few tokens: 16 leaves room for "The answer is -12." and cuts rambling short
    # (a cut ramble states no answer and scores 0), halving rollout time versus 32. The format
    # reward pays 0.2 for a short answer that holds a number (the reference article's recipe).
    # A demonstration is the bare answer ("47", "-5"): what the strict accuracy passes and the
    # format reward pays for (at most 16 characters).
    facts=Facts(
        wide_eval=wide_rows,
        max_new_tokens=16,
        rewards=("accuracy", "format"),
        demonstration=lambda columns: columns.get("answer"),
        validation=validation,
    ),
)
