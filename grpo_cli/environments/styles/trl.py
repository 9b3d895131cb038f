"""environment.style=trl: environment.fn is a TRL environment_factory class, taken as it is
(grpo_cli/environments/trl_class.py: one instance per episode, public methods as tools,
get_reward)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_cli.environments import load_object
from grpo_cli.environments.styles import Facts
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin


def build(cfg: Any, path: str, where: str) -> Callable[[], Any]:
    """A maker of TrlEnv around a fresh instance of the class at `path` (UserError where it is not
    a class with reset)."""
    from grpo_cli.environments.trl_class import check_trl_class, trl_factory

    factory = load_object(path, where)
    for problem in check_trl_class(factory, path):
        raise UserError(problem)
    return trl_factory(factory, cfg)


PLUGIN = Plugin(
    name="trl",
    build=build,
    # Its get_reward() scores the episode, as TRL's environment_factory runs do.
    facts=Facts(
        fn="the TRL environment class by import path (environment.fn=my_pkg.envs:MyEnv)",
        rewards=("environment",),
    ),
)
