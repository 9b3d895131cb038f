"""TRL's environment classes as they are (environment.style=trl): the class TRL's GRPOTrainer takes
as `environment_factory` (trl/trainer/grpo_trainer.py, 1.16: "The environment class should define
methods that can be invoked as tools during generation ... a callable `reset` ... The `reset`
method should return either `None` or a string: when it returns a string, that string is
appended to the last user message before generation. The environment may also define a
`get_reward` method taking no argument and returning a `float`").

    environment.fn=my_pkg.envs:Counter environment.style=trl

What grpo-cli does with it, as TRL does:
- one instance per episode, made by calling the class (its constructor is the factory);
- `reset(**row)` per episode (row: the example's columns and its `prompt`); a string it returns
  is appended to the prompt's last user message;
- its public methods (not `reset`, `get_reward`, `close`, nor a name starting with `_`) are the
  tools: the chat template's own protocol where the template renders tools
  (environment.protocol=native; their JSON schemas from type hints and docstrings, as TRL builds
  them), else the tag protocol (`<name>argument</name>` for a method of one parameter,
  `<name>{"a": 1, "b": 2}</name>` for several); bad arguments are a tool error the model reads;
- `get_reward()`, where the class defines it, is the episode's environment reward (the
  `env_reward` column, the `environment` reward); `close()`, where it defines it, is called after
  the episode however it ended.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from grpo_cli.environments import Reply, ToolEnv
from grpo_cli.errors import UserError

#: Methods of a TRL class that are not tools.
NOT_TOOLS = ("reset", "get_reward", "close")


def class_methods(cls: type) -> dict[str, Callable]:
    """The functions a class defines (inherited ones too), by name, read from the class (never
    from an instance: a property would run)."""
    return dict(inspect.getmembers(cls, predicate=inspect.isfunction))


def tool_names(cls: type) -> list[str]:
    """A TRL class's tools: its public methods other than NOT_TOOLS, in name order (TRL's)."""
    return [name for name in class_methods(cls) if name not in NOT_TOOLS and not name.startswith("_")]


def check_trl_class(cls, path: str) -> list[str]:
    """environment.style=trl: the class has a callable reset (TRL requires it)."""
    if not isinstance(cls, type):
        return [
            f"environment.fn={path!r} is {type(cls).__name__}, not a class: environment.style=trl takes a TRL "
            "environment class (its constructor makes one instance per episode)."
        ]
    if "reset" not in class_methods(cls):
        return [
            f"environment.fn={path!r}: class {cls.__name__} has no reset method; a TRL environment class "
            "defines reset(**row) -> str | None (and its tools as public methods)."
        ]
    return []


class TrlEnv:
    """One episode's TRL environment instance, as grpo-cli's environment interface."""

    def __init__(self, instance, *, timeout_s: float, protocol: str):
        cls = type(instance)
        methods = class_methods(cls)
        self.instance = instance
        self.tools = ToolEnv(
            [getattr(instance, name) for name in tool_names(cls)], timeout_s=timeout_s, protocol=protocol
        )
        self.stop = self.tools.stop
        self.template_tools = self.tools.template_tools
        self._get_reward = instance.get_reward if "get_reward" in methods else None
        self._close = instance.close if "close" in methods else None

    def reset(self, row: dict) -> list[dict]:
        observation = self.instance.reset(**row)
        messages = self.tools.reset(row) if self.tools.tools else _messages(row["prompt"])
        if observation is None:
            return messages
        if not isinstance(observation, str):
            raise UserError(
                f"environment.style=trl: {type(self.instance).__name__}.reset returned "
                f"{type(observation).__name__}; it must return None or a string (appended to the last user message)."
            )
        last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        return [
            *messages[:last],
            {**messages[last], "content": str(messages[last]["content"]) + observation},
            *messages[last + 1 :],
        ]

    def step(self, text: str) -> Reply:
        if not self.tools.tools:
            return Reply(done=True)  # no tools: one turn
        return self.tools.step(text)

    def reward(self) -> float | None:
        return None if self._get_reward is None else self._get_reward()

    def close(self) -> None:
        if self._close is not None:
            self._close()


def _messages(prompt) -> list[dict]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def trl_factory(cls: type, cfg) -> Callable[[], TrlEnv]:
    """A function making one episode's environment: a fresh instance of the TRL class."""
    return lambda: TrlEnv(cls(), timeout_s=cfg.timeout_s, protocol=cfg.protocol)
