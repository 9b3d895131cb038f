"""Format reward: ``value`` when the completion passes every configured check,
else 0.0.

Checks (all optional, all on the completion text with surrounding whitespace
stripped):

``min_chars`` (default 1)
    at least this many characters (so an empty completion fails by default).
``max_chars`` (default None = no limit)
    at most this many characters.
``require_number`` (default False)
    the text holds at least one digit.
``pattern`` (default None) and ``pattern_mode`` (default ``"fullmatch"``)
    a Python regex; ``fullmatch``: the whole stripped text must match,
    ``search``: it must occur somewhere. Compiled with ``re.DOTALL`` so ``.``
    also matches newlines.
``required_tags`` (default None)
    e.g. ``["think", "answer"]``: each ``<tag>...</tag>`` pair appears exactly
    once and the pairs come in the listed order (``<think>`` closed before
    ``<answer>`` opens). Text outside the tags is allowed; use ``pattern`` to
    forbid it.

The reference article's rule (ref 004: 0.2 when the output is short and holds
a number) is ``max_chars: 16, require_number: true, value: 0.2``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, List, Optional  # (Optional/List: OmegaConf reads Options' types)

from ._common import (
    check_bool,
    check_choice,
    check_int,
    check_real,
    check_unknown,
    completion_text,
    raise_problems,
)
from .base import Reward


@dataclass(frozen=True)
class Options:
    """format's options (reward.format.<option>): the one place their defaults live. The shipped
    preset (conf/reward/format.yaml) sets the reference article's rule over them."""

    max_chars: Optional[int] = None  # at most this many characters (stripped); null: no limit
    min_chars: int = 1
    pattern: Optional[str] = None  # a regex the (stripped) completion must match
    pattern_mode: str = "fullmatch"  # PATTERN_MODES
    require_number: bool = False  # the completion must hold a number
    required_tags: Optional[List[str]] = None  # e.g. [think, answer]: each <tag>...</tag> in order
    value: float = 1.0  # the reward of a completion that passes every check


ROLE = "shaping"  # it shapes the output; it does not say whether an answer is right
OPTIONS = tuple(f.name for f in fields(Options))
_D = Options()
PATTERN_MODES = ("fullmatch", "search")
_TAG_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]*")


@lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def check_options(options: Mapping[str, Any], *, unknown: bool = True) -> list[str]:
    """Problems with format's options (``unknown``: also flag unknown keys)."""
    problems: list[str] = []
    if unknown:
        check_unknown(problems, options, OPTIONS)
    max_chars = options.get("max_chars")
    min_chars = options.get("min_chars", _D.min_chars)
    check_int(problems, "max_chars", max_chars, minimum=0, allow_none=True)
    check_int(problems, "min_chars", min_chars, minimum=0)
    if (
        isinstance(max_chars, int)
        and isinstance(min_chars, int)
        and not isinstance(max_chars, bool)
        and not isinstance(min_chars, bool)
        and max_chars < min_chars
    ):
        problems.append(f"option max_chars ({max_chars}) is below min_chars ({min_chars}); nothing can pass")
    pattern = options.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            problems.append(f"option pattern must be a regex string, got {pattern!r}")
        else:
            try:
                _compile(pattern)
            except re.error as exc:
                problems.append(f"option pattern {pattern!r} is not a valid regex: {exc}")
    check_choice(problems, "pattern_mode", options.get("pattern_mode", _D.pattern_mode), PATTERN_MODES)
    check_bool(problems, "require_number", options.get("require_number", _D.require_number))
    tags = options.get("required_tags")
    if tags is not None:
        if isinstance(tags, str) or not isinstance(tags, Sequence) or not tags:
            problems.append(f"option required_tags must be a non-empty list of tag names, got {tags!r}")
        else:
            for tag in tags:
                if not isinstance(tag, str) or not _TAG_NAME_RE.fullmatch(tag):
                    problems.append(
                        f"option required_tags: {tag!r} is not a tag name (write think, not <think>)"
                    )
            if len(set(map(str, tags))) != len(tags):
                problems.append(f"option required_tags lists a tag twice: {list(tags)!r}")
    check_real(problems, "value", options.get("value", _D.value))
    return problems


def _tags_ok(text: str, tags: Sequence[str]) -> bool:
    pos = 0
    for tag in tags:
        open_tag, close_tag = f"<{tag}>", f"</{tag}>"
        if text.count(open_tag) != 1 or text.count(close_tag) != 1:
            return False  # missing or repeated (e.g. several <answer> blocks)
        start = text.find(open_tag)
        end = text.find(close_tag)
        if start < pos or end < start + len(open_tag):
            return False  # out of order, or closed before opened
        pos = end + len(close_tag)
    return True


def format_reward(
    completions: list,
    *,
    max_chars: int | None = _D.max_chars,
    min_chars: int = _D.min_chars,
    pattern: str | None = _D.pattern,
    pattern_mode: str = _D.pattern_mode,
    require_number: bool = _D.require_number,
    required_tags: Sequence[str] | None = _D.required_tags,
    value: float = _D.value,
    **kwargs: Any,
) -> list[float]:
    """``value`` for each completion that passes every configured check, else 0.0."""
    raise_problems(
        "format",
        check_options(
            {
                "max_chars": max_chars,
                "min_chars": min_chars,
                "pattern": pattern,
                "pattern_mode": pattern_mode,
                "require_number": require_number,
                "required_tags": required_tags,
                "value": value,
            },
            unknown=False,
        ),
    )
    regex = _compile(pattern) if pattern is not None else None
    reward = float(value)
    rewards = []
    for completion in completions:
        text = completion_text(completion).strip()
        ok = len(text) >= min_chars and (max_chars is None or len(text) <= max_chars)
        if ok and require_number:
            ok = re.search(r"\d", text) is not None
        if ok and regex is not None:
            match = regex.fullmatch(text) if pattern_mode == "fullmatch" else regex.search(text)
            ok = match is not None
        if ok and required_tags:
            ok = _tags_ok(text, list(required_tags))
        rewards.append(reward if ok else 0.0)
    return rewards


REWARD = Reward(name="format", fn=format_reward, options=Options, check=check_options, role=ROLE)
