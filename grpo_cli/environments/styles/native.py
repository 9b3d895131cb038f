"""environment.style=native (the default): environment.fn is a class or a function of the user's,
called with no arguments for each episode, that makes an environment with grpo-cli's own interface
(grpo_cli/environments/__init__.py: reset(row), step(text), ...). environment.tools (plain
functions, a ToolEnv) may stand in for it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpo_cli.environments import load_object
from grpo_cli.environments.styles import Facts
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin


def build(cfg: Any, path: str, where: str) -> Callable[[], Any]:
    """The class or function at `path`, checked to be one (a TRL-shaped class is refused with a
    pointer to environment.style=trl)."""
    factory = load_object(path, where)
    if not callable(factory):
        raise UserError(f"{where}={path!r} is not a class or a function; it must make an environment.")
    _suggest_style(factory, path)
    return factory


def _suggest_style(factory, path: str) -> None:
    """environment.style=native given a class shaped like TRL's (a reset, no step, public methods
    as tools): one paragraph suggesting environment.style=trl (the style is never guessed)."""
    if not isinstance(factory, type):
        return
    methods = dict(inspect.getmembers(factory, predicate=inspect.isfunction))
    if "reset" in methods and "step" not in methods:
        raise UserError(
            f"environment.fn={path!r}: class {factory.__name__} has reset but no step, so it is not a "
            "grpo-cli environment (reset(row), step(text)); if it is a TRL environment_factory class "
            "(reset(**row), its public methods the tools, get_reward()), set environment.style=trl."
        )


PLUGIN = Plugin(name="native", build=build, facts=Facts(tools=True))
