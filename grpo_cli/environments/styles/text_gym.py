"""environment.style=text_gym: environment.fn is a skyrl-gym BaseTextEnv, by registered id or
import path (grpo_cli/environments/text_gym.py); environment.env_config and reward_turns are
read by this style alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_cli.environments.styles import Facts
from grpo_cli.plugins import Plugin


def build(cfg: Any, path: str, where: str) -> Callable[[], Any]:
    """A maker of TextGymEnv for the id or class `path` (UserError where skyrl-gym is missing or
    `path` names none of its environments)."""
    from grpo_cli.environments.text_gym import text_gym_factory

    return text_gym_factory(cfg, path)


PLUGIN = Plugin(
    name="text_gym",
    build=build,
    facts=Facts(
        fn="a skyrl-gym environment id or BaseTextEnv class (environment.fn=gsm8k)",
        keys=("env_config", "reward_turns"),
        rewards=("environment",),  # its step rewards score the episode (environment.reward_turns)
    ),
)
