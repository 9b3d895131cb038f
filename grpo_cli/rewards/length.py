"""Length reward/penalty with an explicit unit.

``unit`` says what "length" means (ref 000.5: a length measured in characters
is not token length):

``tokens`` (default)
    ``len(completion_ids[i])``, the number of generated token ids the engine
    passes (without padding). Missing ``completion_ids`` raises.
``chars``
    ``len(text)`` of the completion text (not stripped).

Modes, with ``L`` the length, ``d = |L - target| / target``:

``penalty`` (default)
    ``-d``: 0 at the target, -1 at twice (or zero) the target, unbounded below.
``reward``
    ``1 - min(1, d)``: 1 at the target, falling linearly to 0 at distance
    ``target`` and staying 0 beyond.
``dapo_overlong``
    0 (only the over-length term below; ``target`` is not used).

Over-length term (DAPO soft overlong punishment, ref 004 length bias), added in
every mode when ``max_length`` is set: 0 while ``L <= max_length - soft_cache``,
then linear down to -1 at ``L = max_length``, and -1 beyond. ``soft_cache``
defaults to 0 (a hard -1 above ``max_length``). ``dapo_overlong`` requires
``max_length``.

The result is multiplied by ``scale`` (default 1.0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional  # (Optional/List: OmegaConf reads Options' types)

from ._common import (
    RewardError,
    check_choice,
    check_int,
    check_real,
    check_unknown,
    completion_text,
    is_real,
    raise_problems,
)
from .base import Reward

UNITS = ("tokens", "chars")
MODES = ("penalty", "reward", "dapo_overlong")


@dataclass(frozen=True)
class Options:
    """length's options (reward.length.<option>): the one place their defaults live."""

    target: Optional[float] = None  # the desired length in `unit` (penalty and reward modes need it)
    unit: str = "tokens"  # UNITS
    mode: str = "penalty"  # MODES
    scale: float = 1.0
    max_length: Optional[int] = None  # dapo_overlong: the hard limit
    soft_cache: Optional[int] = None  # dapo_overlong: the soft zone's width before max_length


ROLE = "shaping"
OPTIONS = tuple(f.name for f in fields(Options))
_D = Options()


def check_options(options: Mapping[str, Any], *, unknown: bool = True) -> list[str]:
    """Problems with length's options (``unknown``: also flag unknown keys)."""
    problems: list[str] = []
    if unknown:
        check_unknown(problems, options, OPTIONS)
    mode = options.get("mode", _D.mode)
    check_choice(problems, "mode", mode, MODES)
    check_choice(problems, "unit", options.get("unit", _D.unit), UNITS)
    check_real(problems, "scale", options.get("scale", _D.scale))
    target = options.get("target")
    if target is None:
        if mode in ("penalty", "reward"):
            problems.append(f"option target is required with mode {mode!r} (the desired length in `unit`)")
    else:
        check_real(problems, "target", target, strictly_positive=True)
    max_length = options.get("max_length")
    soft_cache = options.get("soft_cache")
    check_int(problems, "max_length", max_length, minimum=1, allow_none=True)
    check_int(problems, "soft_cache", soft_cache, minimum=0, allow_none=True)
    if max_length is None:
        if mode == "dapo_overlong":
            problems.append("option max_length is required with mode 'dapo_overlong'")
        if soft_cache is not None:
            problems.append("option soft_cache needs max_length (the soft zone ends at max_length)")
    elif is_real(max_length) and is_real(soft_cache) and soft_cache > max_length:
        problems.append(f"option soft_cache ({soft_cache}) must not exceed max_length ({max_length})")
    return problems


def overlong_penalty(length: int, max_length: int, soft_cache: int = 0) -> float:
    """DAPO soft overlong punishment in [-1, 0]."""
    start = max_length - soft_cache
    if length <= start:
        return 0.0
    if length > max_length:
        return -1.0
    return (start - length) / soft_cache  # soft_cache > 0 here: start < length <= max_length


def length(
    completions: list,
    completion_ids: list | None = None,
    *,
    target: float | None = _D.target,
    unit: str = _D.unit,
    mode: str = _D.mode,
    scale: float = _D.scale,
    max_length: int | None = _D.max_length,
    soft_cache: int | None = _D.soft_cache,
    **kwargs: Any,
) -> list[float]:
    """Reward or penalty for each completion's length relative to ``target``."""
    options = {
        "target": target,
        "unit": unit,
        "mode": mode,
        "scale": scale,
        "max_length": max_length,
        "soft_cache": soft_cache,
    }
    raise_problems("length", check_options(options, unknown=False))
    if unit == "tokens":
        if completion_ids is None:
            raise RewardError(
                "length: unit='tokens' needs completion_ids (the generated token ids), but none were "
                "passed; set unit: chars to measure characters instead"
            )
        if len(completion_ids) != len(completions):
            raise RewardError(
                f"length: got {len(completion_ids)} completion_ids for {len(completions)} completions"
            )
        lengths = [len(ids) for ids in completion_ids]
    else:
        lengths = [len(completion_text(c)) for c in completions]
    rewards = []
    for n in lengths:
        if mode == "dapo_overlong":
            value = 0.0
        else:
            distance = abs(n - target) / target
            value = -distance if mode == "penalty" else 1.0 - min(1.0, distance)
        if max_length is not None:
            value += overlong_penalty(n, max_length, soft_cache or 0)
        rewards.append(float(scale) * value)
    return rewards


REWARD = Reward(name="length", fn=length, options=Options, check=check_options, role=ROLE)
