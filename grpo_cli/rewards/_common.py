"""Shared helpers for reward functions: the error type, completion text
extraction, number scanning and option checks.

Private module: the public names are re-exported from ``grpo_cli.rewards``.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_cli.errors import UserError


class RewardError(UserError, ValueError):
    """A reward could not be configured or computed.

    Raised by :func:`grpo_cli.rewards.resolve_reward`, ``build_rewards``,
    ``score_rewards`` and the built-in rewards themselves. The message is meant
    to be shown to the user as-is.
    """


# Shown as grpo_cli.rewards.RewardError in tracebacks (that is where users import it).
RewardError.__module__ = "grpo_cli.rewards"


# --------------------------------------------------------------------------
# completions
# --------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Multimodal chat format: [{"type": "text", "text": "..."}, ...]
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise RewardError(f"unsupported message content of type {type(content).__name__}: {content!r:.80}")


def completion_text(completion: Any) -> str:
    """Return the text of one completion.

    Accepts a plain string, one chat message ``{"role": ..., "content": ...}``
    or a list of chat messages (TRL's conversational format). For a message
    list, the contents of all assistant messages (messages without a role
    count as assistant) are joined with newlines, so a reward sees everything
    the policy wrote. Anything else raises :class:`RewardError`; completions are
    never silently ``str()``-ed (ref 004: completions may be plain strings or
    chat messages).
    """
    if isinstance(completion, str):
        return completion
    if completion is None:
        return ""
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        texts = []
        for message in completion:
            if not isinstance(message, Mapping):
                raise RewardError(
                    "a chat completion must be a list of {'role': ..., 'content': ...} dicts, "
                    f"got an element of type {type(message).__name__}: {message!r:.80}"
                )
            if message.get("role", "assistant") == "assistant":
                texts.append(_content_text(message.get("content")))
        return "\n".join(texts)
    raise RewardError(
        f"unsupported completion type {type(completion).__name__} (expected str or a list of chat messages)"
    )


def preview(text: Any, limit: int = 120) -> str:
    """Truncated repr of a completion for error messages."""
    if not isinstance(text, str):
        try:
            text = completion_text(text)
        except RewardError:
            text = repr(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


# --------------------------------------------------------------------------
# numbers in free text
# --------------------------------------------------------------------------

# A plain number: 47, 1,234 (comma thousands separators, exact groups of 3),
# 47.0, .5, 3/4, optionally followed by %. ASCII digits and ASCII boundaries on
# purpose: Python's \w is Unicode, so `(?<!\w)` would reject "答案是47".
# "470" can never yield "47": the digit run is maximal on both sides.
_NUMBER_CORE = r"(?:[0-9]+/[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
NUMBER_RE = re.compile(rf"(?<![0-9A-Za-z_./]){_NUMBER_CORE}(?![0-9]|\.[0-9]|/[0-9])%?")
_MINUS = "-\u2212"  # ASCII hyphen-minus and U+2212
# Arithmetic operators: a number next to one of these is an operand, not a stated result.
_OPERATORS = "+-\u2212*/\u00d7\u00f7^\u00b7"


def iter_numbers(text: str):
    """Yield ``(start, end, literal, standalone)`` for each plain number in ``text``.

    ``literal`` includes a leading minus sign when the minus is a sign (at the
    start, after whitespace, ``=``, ``(`` ...), not a binary operator
    (``10-5``, ``3 - 5``). ``standalone`` is False for operands of arithmetic
    (``12`` and ``35`` in ``12 + 35 = 47``) and for the left side of ``=``;
    results after ``=`` are standalone.
    """
    for m in NUMBER_RE.finditer(text):
        start, end = m.start(), m.end()
        literal = m.group(0)
        if start > 0 and text[start - 1] in _MINUS:
            before_minus = text[: start - 1].rstrip()
            prev_char = before_minus[-1:] if before_minus else ""
            glued = start >= 2 and (text[start - 2].isalnum() or text[start - 2] in "_)]")
            # ("" in ")]" is True in Python: test for an empty prefix first.)
            if not glued and not (prev_char.isdigit() or (prev_char != "" and prev_char in ")]")):
                start -= 1
                literal = "-" + literal
        before = text[:start].rstrip()
        after = text[end:].lstrip()
        prev_char = before[-1:] if before else ""
        next_char = after[:1]
        operand = (prev_char != "" and prev_char in _OPERATORS) or (
            next_char != "" and next_char in _OPERATORS + "="
        )
        # "47." / "47.\n" is a sentence end, not an operator; "-" was handled above.
        yield start, end, literal, not operand


def last_number(text: str) -> str | None:
    """The last plain number in ``text`` (with its sign), or None."""
    found = None
    for _, _, literal, _ in iter_numbers(text):
        found = literal
    return found


# --------------------------------------------------------------------------
# option checks (used by the rewards at call time and by check_rewards)
# --------------------------------------------------------------------------


def is_real(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(
    problems: list[str],
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    strictly_positive: bool = False,
    allow_none: bool = False,
) -> None:
    if value is None and allow_none:
        return
    if not is_real(value) or not math.isfinite(float(value)):
        problems.append(f"option {name} must be a finite number, got {value!r}")
        return
    if strictly_positive and value <= 0:
        problems.append(f"option {name} must be > 0, got {value!r}")
    elif minimum is not None and value < minimum:
        problems.append(f"option {name} must be >= {minimum}, got {value!r}")


def check_int(
    problems: list[str], name: str, value: Any, *, minimum: int = 0, allow_none: bool = False
) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        problems.append(f"option {name} must be an integer, got {value!r}")
    elif value < minimum:
        problems.append(f"option {name} must be >= {minimum}, got {value!r}")


def check_bool(problems: list[str], name: str, value: Any) -> None:
    if not isinstance(value, bool):
        problems.append(f"option {name} must be true or false, got {value!r}")


def check_choice(problems: list[str], name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        problems.append(f"option {name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_unknown(problems: list[str], options: Mapping[str, Any], known: Sequence[str]) -> None:
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown option {key!r}{hint}; valid options: {', '.join(sorted(known))}")


def raise_problems(reward: str, problems: list[str]) -> None:
    if problems:
        raise RewardError(f"{reward}: " + "; ".join(problems))
