"""How a reward function is called: TRL's keyword-only call where the function names a
`completions` parameter, grpo-cli's `fn(completions, **kwargs)` otherwise; and what a signature
takes. No other module of the package is imported here (scoring, workers and base all call it)."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def by_keyword(fn: Callable) -> bool:
    """Whether a reward takes TRL's keyword-only call: it names `completions` as a parameter (TRL
    calls every reward as fn(prompts=..., completions=..., completion_ids=..., trainer_state=...,
    log_metric=..., log_extra=..., **columns)). Any other function keeps grpo-cli's documented
    call, fn(completions, **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    named = params.get("completions")
    return named is not None and named.kind is not inspect.Parameter.VAR_POSITIONAL


def invoke(fn: Callable, completions: list, kwargs: dict):
    """One call of a reward function: all by keyword where it names `completions` (TRL's call,
    by_keyword), else completions first (grpo-cli's documented call)."""
    if by_keyword(fn):
        return fn(completions=completions, **kwargs)
    return fn(completions, **kwargs)


def requires_parameter(fn: Callable, name: str) -> bool:
    """Whether fn names `name` as a parameter without a default."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def names_parameter(fn: Callable, name: str) -> bool:
    """Whether fn names `name` as a parameter of its own (not only through **kwargs)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
