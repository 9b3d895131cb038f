"""The environment's own reward as a reward (reward=[environment]): an environment's `reward()`
(native style) or `get_reward()` (a TRL class, environment.style=trl), given to the rewards as the
`env_reward` column; None where the environment gave none ("not applicable": the other rewards
still count). TRL adds a class's get_reward as a reward of weight 1; here it is one of the
configured rewards, its weight and role set in YAML like any other's."""

from __future__ import annotations

from dataclasses import dataclass

from ._common import RewardError
from .base import Reward


@dataclass(frozen=True)
class Options:
    """environment's options: none (the environment gives the value; weight and role as for any reward)."""


def environment(completions, env_reward=None, **kwargs) -> list[float | None]:
    if env_reward is None:
        raise RewardError(
            "reward 'environment' scores with the environment's own reward, and this run has no "
            "environment: choose one (environment=feedback, environment.fn=...), or drop the environment reward."
        )
    return [None if value is None else float(value) for value in env_reward]


REWARD = Reward(name="environment", fn=environment, options=Options)
