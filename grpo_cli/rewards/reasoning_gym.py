"""reasoning-gym's own scorer as the correctness reward (reward=[reasoning_gym], with
data=reasoning_gym; docs/reasoning-gym.md).

The completion's answer is the text after the last ``marker`` (default ``Answer:``, what the
data source's prompts ask for; case-insensitive): the rest of that line, or the next non-empty
line when the marker ends its line. Without a marker, the completion's last non-empty line; where
the gold answer is a plain number, the last number of that line ("1 + 5 = 6", "The answer is 6."
state 6: what a small model writes, and the rule of grpo-cli's accuracy reward).
Surrounding ``*`` and backticks are stripped, and one trailing ``.`` unless the gold answer ends
with one. The answer is scored by the row's task: ``reasoning_gym.get_score_answer_fn(task)(answer,
entry)`` with entry = {question, answer, metadata} of the row, a value in [0, 1]. Part marks
(reasoning-gym 0.1.25): the base scorer, which basic_arithmetic, chain_sum, leg_counting,
letter_counting and simple_equations use, gives len(gold)/len(answer) to an answer that holds the
gold answer among other text ("42 apples" for 42); spell_backward credits each letter in its
place, word_sorting each word; number_sorting is 1 or 0. grpo-cli's accuracy counts a completion
as passed at 1.0 only, so part marks train but do not pass.

A row without a task (None) gets None (not applicable); a scorer that raises gives 0.0.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from grpo_cli.data.reasoning_gym import MARKER, MISSING_PACKAGE

from ._common import RewardError, check_unknown, completion_text
from .base import Reward


@dataclass(frozen=True)
class Options:
    """reasoning_gym's options (reward.reasoning_gym.<option>): the one place their defaults live."""

    marker: str = MARKER  # the completion's answer is the text after the last one


ROLE = "correctness"
OPTIONS = tuple(f.name for f in fields(Options))
_D = Options()
_WRAPPERS = "*` \t"


def check_options(options: Mapping[str, Any], *, unknown: bool = True) -> list[str]:
    """Problems with reasoning_gym's options (``unknown``: also flag unknown keys)."""
    problems: list[str] = []
    if unknown:
        check_unknown(problems, options, OPTIONS)
    marker = options.get("marker", _D.marker)
    if not isinstance(marker, str) or not marker.strip():
        problems.append(f"option marker must be non-empty text (e.g. 'Answer:'), got {marker!r}")
    return problems


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str, marker: str = _D.marker, gold: str | None = None) -> str | None:
    """The answer a completion states (see the module docstring); None when it states nothing."""
    at = text.lower().rfind(marker.lower())
    if at >= 0:
        rest = text[at + len(marker) :]
        lines = [line for line in rest.splitlines() if line.strip(_WRAPPERS)]
        found = lines[0] if lines else ""
    else:
        lines = [line for line in text.splitlines() if line.strip(_WRAPPERS)]
        found = lines[-1] if lines else ""
        numbers = _NUMBER.findall(found)
        if gold is not None and _NUMBER.fullmatch(gold.strip()) and numbers:
            return numbers[-1]
    found = found.strip(_WRAPPERS)
    if found.endswith(".") and not found.endswith("..") and not (gold or "").endswith("."):
        found = found[:-1].strip(_WRAPPERS)
    return found or None


@functools.cache
def scorer(task: str) -> Callable[[str | None, dict], float]:
    """reasoning-gym's score function of `task` (built once per process)."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise RewardError(MISSING_PACKAGE.replace("data.source", "reward", 1) + f" ({exc}).") from exc
    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError as exc:
        raise RewardError(
            f"reasoning_gym: the row's task {task!r} is not a reasoning-gym task ({exc}); the `task` column "
            "must hold a reasoning-gym task's name (data=reasoning_gym makes it)."
        ) from exc


def score_answer(task: str, answer: str | None, entry: dict) -> float:
    """The task's score of `answer` for `entry`, in [0, 1]; 0.0 when the scorer raises."""
    fn = scorer(task)
    try:
        value = float(fn(answer, entry))
    except Exception:  # noqa: BLE001 - a malformed answer the task's parser chokes on is wrong
        return 0.0
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def reasoning_gym_reward(
    completions: list,
    task: list | None = None,
    answer: list | None = None,
    metadata: list | None = None,
    question: list | None = None,
    *,
    marker: str = _D.marker,
    **kwargs: Any,
) -> list[float | None]:
    """Each completion's score by its row's task (reasoning-gym's scorer)."""
    if task is None or answer is None:
        raise RewardError(
            "reasoning_gym needs the columns task and answer (data=reasoning_gym makes them); the data "
            "has no column " + ("task" if task is None else "answer")
        )
    n = len(completions)
    metadata = metadata if metadata is not None else [{}] * n
    question = question if question is not None else [""] * n
    out: list[float | None] = []
    for completion, name, gold, meta, q in zip(completions, task, answer, metadata, question):
        if name is None or gold is None:
            out.append(None)
            continue
        entry = {"question": q or "", "answer": str(gold), "metadata": dict(meta or {})}
        found = extract_answer(completion_text(completion), marker, str(gold))
        out.append(score_answer(str(name), found, entry))
    return out


REWARD = Reward(
    name="reasoning_gym",
    fn=reasoning_gym_reward,
    options=Options,
    check=check_options,
    role=ROLE,
    columns=lambda options: ["task", "metadata"],
)
