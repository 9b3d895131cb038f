"""Environments: multi-turn episodes in place of one completion per prompt (docs/environments.md).

An environment is any object with this small interface (a user's by import path,
`environment.fn=my_pkg.my_env:MyEnv`, a class or factory called with no arguments):

    stop: list[str]                 optional: strings that end the model's turn besides its end of
                                    turn (a tool's closing tag); the tokens stay as sampled
    metrics: tuple[str, ...]        optional: the names of its own per-episode metrics, whose
                                    values its replies carry (Reply.metrics, summed over the
                                    episode's turns) and the run logs as env/<name>, the mean
                                    per episode
    reset(row) -> messages | None   row: the example's columns and its `prompt`. Messages replace
                                    the prompt (rendered like the data's, data.system_prompt and
                                    all); None keeps it. Each episode has its own environment,
                                    made by the factory and reset with the row.
    close() -> None                 optional: called after the episode, however it ended
    step(text) -> Reply | str | None
                                    the model's turn, as text; what the environment says back
                                    (a str: a reply; None: the episode is done)
    reward() -> float | None        optional: the episode's own reward, given to the rewards as
                                    the `env_reward` column (the `environment` reward returns it)
    instance                        optional: the object a reward that names `environments` (TRL's
                                    keyword) gets for the episode (default: the environment itself);
                                    such a run keeps the environments open until they are scored

environment.fn may also map names to environments ({math: my_pkg.envs:Math, game: ...}): each
row's `environment` column picks its episode's (TRL 1.16's dict environment_factory), and that
column is not passed to reset.

environment.style says what environment.fn is: native (the default) this interface;
trl a TRL environment_factory class (environments/trl_class.py); text_gym a skyrl-gym BaseTextEnv,
by registered id or import path (environments/text_gym.py). Each style is a plug-in, a module of
environments/styles/ (or a user's by import path, environment.style=my_pkg.my_style), whose build
turns environment.fn into a maker of fresh environments.

A Reply's keep_text (a skyrl-gym postprocessed_action) cuts the turn's sampled tokens at the
shortest prefix that decodes to it exactly; where none does, the turn is kept whole and counted
as the metric ACTION_NOT_CUT, which such an environment declares in its `metrics`.

How a reply joins the token sequence (never a re-rendering of the history): after a turn that
ended at one of `stop`, inline, right after the sampled tokens (the model goes on with its own
message); after a turn that ended with the end-of-turn token, as a chat message of Reply.role,
the chat template's text between an end of turn and the next assistant turn (the newline after
the end-of-turn token included, the end-of-turn token itself not repeated). Its tokens are
attended to and never trained (Rollout.trained_mask).

Plain functions given as tools (`environment.tools=[my_pkg.tools:search]`) make a ToolEnv: the
model calls `search` by writing `<search>query</search>` and reads `<result>...</result>`; the
prompt lists the tools (their docstrings' first lines) and shows worked examples (a tool's
`examples` attribute).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_cli import calls, plugins
from grpo_cli.chat_template import render
from grpo_cli.environments import styles
from grpo_cli.errors import UserError


@dataclass(frozen=True)
class Reply:
    """What an environment says back after a turn."""

    content: str | None = None  # None: nothing to say
    done: bool = False  # the episode ends (after `content`, which the model then never answers)
    role: str = "user"  # the chat role of a reply to a finished turn ("user", "tool")
    tool_call: bool = False  # counted: the turn called a tool
    error: bool = (
        False  # counted: the call failed (unknown tool, bad arguments, the tool raised or timed out)
    )
    # Its own metrics' values for this turn (names from the environment's declared `metrics`),
    # summed over the episode: {"attempts": 1}.
    metrics: Mapping[str, float] = field(default_factory=dict)
    # What of the turn's text the episode keeps (a strict prefix: a stop-string cut the environment
    # made, skyrl-gym's postprocessed_action); its sampled tokens are cut there, token-exact. None:
    # the turn as sampled.
    keep_text: str | None = None


#: The metric counting turns whose Reply.keep_text no prefix of the sampled tokens decodes to.
ACTION_NOT_CUT = "action_not_cut"


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float, what: str):
    """fn(*args), at most environment.timeout_s seconds (calls.call_with_timeout)."""
    return calls.call_with_timeout(fn, args, timeout_s, what, "environment.timeout_s")


#: environment.protocol's values: how a ToolEnv's tools are called (config validation reads them).
PROTOCOLS = ("tag", "native")


class ToolEnv:
    """Plain functions as tools. protocol tag (any model): `<name>argument</name>` calls
    `name(argument)`; the reply, inline, is `<result>value</result>` or `<error>why</error>`.
    protocol native (a chat template that renders tools, e.g. Qwen2.5's): the template lists the
    tools (their JSON schemas, transformers.utils.get_json_schema), the model ends its turn with
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the result comes back as a
    `tool` message in the template's own format. A turn that ends without a call ends the episode."""

    def __init__(self, tools: list[Callable], *, timeout_s: float = 10.0, protocol: str = "tag"):
        self.tools = {fn.__name__: fn for fn in tools}
        self.timeout_s = timeout_s
        self.protocol = protocol
        self.stop = [f"</{name}>" for name in self.tools] if protocol == "tag" else []
        self._call = re.compile(r"<(\w+)>(.*?)</\1>", re.S)
        self._native_call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
        # The tools as the chat template takes them (native): what Episodes passes as tools=.
        self.template_tools = [tool_schema(fn) for fn in tools] if protocol == "native" else None

    def instructions(self) -> str:
        lines = ["You can use these tools. Write the call in tags; the result comes back in <result> tags."]
        for name, fn in self.tools.items():
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            params = _parameters(fn)
            shown = "..." if len(params) <= 1 else "{" + ", ".join(f'"{p}": ...' for p in params) + "}"
            lines.append(f"<{name}>{shown}</{name}>: {doc[0] if doc else name}")
        return "\n".join(lines)

    def demonstrations(self) -> list[dict]:
        """Worked examples as chat turns, from each tool's `examples` attribute ((question,
        argument) pairs): the user asks, the assistant calls, the result, the answer. A small
        model follows turns it has seen far more readily than a description (SmolLM2-135M:
        docs/environments.md)."""
        turns = []
        for name, fn in self.tools.items():
            for question, argument in getattr(fn, "examples", ()):
                value = fn(argument)
                answer = f"<{name}>{argument}</{name}><result>{value}</result>\n{value}"
                turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return turns

    def reset(self, row: dict) -> list[dict]:
        prompt = row["prompt"]
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.protocol == "native":
            return messages  # the template renders the tools (template_tools)
        system = {"role": "system", "content": self.instructions()}
        if messages and messages[0].get("role") == "system":
            system = {**messages[0], "content": f"{messages[0]['content']}\n\n{self.instructions()}"}
            messages = messages[1:]
        return [system, *self.demonstrations(), *messages]

    def step(self, text: str) -> Reply:
        if self.protocol == "native":
            return self._native_step(text)
        calls = list(self._call.finditer(text))
        # The call must end the turn: a turn that calls stops at the closing tag, whose last token
        # may carry a character or two more ("</calc><" when "><" is one token).
        call = calls[-1] if calls else None
        if call is None or len(text[call.end() :].strip()) > 3:
            return Reply(done=True)  # an answer, not a call
        name, argument = call.group(1), call.group(2)
        if name not in self.tools:
            return Reply(f"<error>no tool named {name}</error>", role="tool", tool_call=True, error=True)
        fn = self.tools[name]
        try:
            args, kwargs = tag_arguments(fn, argument)
        except (ValueError, TypeError) as exc:  # the model sees its bad arguments, the run goes on
            return Reply(
                f"<error>bad arguments for {name}: {exc}</error>", role="tool", tool_call=True, error=True
            )
        try:
            value = call_with_timeout(lambda: fn(*args, **kwargs), (), self.timeout_s, f"tool {name}")
        except Exception as exc:  # noqa: BLE001 - the model sees what went wrong, the run goes on
            return Reply(f"<error>{exc}</error>", role="tool", tool_call=True, error=True)
        return Reply(f"<result>{value}</result>", role="tool", tool_call=True)

    def _native_step(self, text: str) -> Reply:
        calls = list(self._native_call.finditer(text))
        if not calls:
            return Reply(done=True)
        try:
            call = json.loads(calls[-1].group(1))
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(arguments, dict):
                raise TypeError("arguments must be an object")
        except (ValueError, KeyError, TypeError) as exc:
            return Reply(
                f"error: the tool call does not parse ({exc})", role="tool", tool_call=True, error=True
            )
        if name not in self.tools:
            return Reply(f"error: no tool named {name}", role="tool", tool_call=True, error=True)
        try:
            value = call_with_timeout(
                lambda: self.tools[name](**arguments), (), self.timeout_s, f"tool {name}"
            )
        except Exception as exc:  # noqa: BLE001 - the model sees what went wrong, the run goes on
            return Reply(f"error: {exc}", role="tool", tool_call=True, error=True)
        return Reply(str(value), role="tool", tool_call=True)


def _parameters(fn: Callable) -> list[str]:
    """A tool's parameter names (a bound method's without self)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def tag_arguments(fn: Callable, argument: str) -> tuple[tuple, dict]:
    """A tag call's arguments: the text itself for a tool of one parameter (`<calc>12-17</calc>`;
    converted to the parameter's type where it is int, float or bool), a JSON object of named
    arguments for a tool of several (`<add>{"a": 1, "b": 2}</add>`). ValueError or TypeError, for
    the model to read, when they do not fit the signature."""
    params = _parameters(fn)
    text = argument.strip()
    if len(params) > 1 or (text.startswith("{") and len(params) != 1):
        try:
            named = json.loads(text)
        except json.JSONDecodeError as exc:
            example = params[0] if params else "x"
            raise ValueError(
                f'write the arguments as a JSON object, e.g. {{"{example}": ...}} ({exc.msg})'
            ) from None
        if not isinstance(named, dict):
            raise ValueError("write the arguments as a JSON object of name: value")
        inspect.signature(fn).bind(**named)  # TypeError: a missing or unknown argument
        return (), named
    if not params:
        return (), {}
    kind = _annotation(fn, params[0])
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{params[0]} is true or false, not {text!r}")
        return (text.lower() == "true",), {}
    if kind in (int, float):
        return (kind(text),), {}  # ValueError: not a number
    return (argument,), {}


def _annotation(fn: Callable, name: str):
    """A parameter's type hint (resolved), or None."""
    try:
        return inspect.signature(fn, eval_str=True).parameters[name].annotation
    except Exception:  # noqa: BLE001 - an unresolvable hint: the text is passed as it is
        return None


def tool_schema(fn: Callable) -> dict:
    """A function's JSON schema for a chat template (its type hints and its docstring's Args)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:
        raise UserError(
            f"environment.protocol=native: tool {fn.__name__!r} has no JSON schema ({exc}); give it type hints "
            "and a docstring with an Args: section (transformers.utils.get_json_schema), or use "
            "environment.protocol=tag."
        ) from exc


def renders_tools(tokenizer, schemas: list[dict]) -> bool:
    """Whether the tokenizer's chat template shows the tools it is given (TRL checks the same),
    rendered as the episodes' prompts are (chat_template.render)."""
    try:
        text = render(tokenizer, [{"role": "user", "content": "hi"}], tools=schemas)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return all(s["function"]["name"] in text for s in schemas)


def load_object(path: str, what: str):
    """`pkg.module:name` -> the object (UserError naming `what` and the path otherwise)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{what}={path!r} is not an import path; write it as package.module:name.")
    try:
        module = plugins.import_user_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"{what}={path!r}: module {module_name!r} cannot be imported ({exc}). Install it, or run "
            "from the folder that holds it."
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{what}={path!r}: module {module_name!r} has no {attr!r}.") from None


#: The row column that picks an episode's environment where environment.fn maps names to
#: environments (TRL 1.16's dict environment_factory reads the same `environment` field).
ROUTE_COLUMN = "environment"


def environment_factory(cfg) -> Callable[[dict], Any] | None:
    """A function making a fresh environment for a row (cfg: config.EnvironmentConfig), None when
    single-turn. environment.fn is one environment, or a mapping of names to environments
    (each as environment.fn takes it, all of environment.style) picked per row by its
    `environment` column, as TRL's dict environment_factory does (routed)."""
    if isinstance(cfg.fn, Mapping):
        return Routed(
            {str(name): _one_factory(cfg, path, f"environment.fn.{name}") for name, path in cfg.fn.items()}
        )
    if cfg.fn:
        one = _one_factory(cfg, cfg.fn, "environment.fn")
        return lambda row: one()
    if cfg.tools:
        tools = [load_object(path, "environment.tools") for path in cfg.tools]
        for path, fn in zip(cfg.tools, tools):
            if not callable(fn):
                raise UserError(f"environment.tools: {path!r} is not a function.")
        return lambda row: ToolEnv(tools, timeout_s=cfg.timeout_s, protocol=cfg.protocol)
    return None


def _one_factory(cfg, path, where: str) -> Callable[[], Any]:
    """One environment's maker, no arguments: environment.fn's (or one entry of its mapping), as
    environment.style's plug-in builds it (environments/styles/)."""
    style = styles.plugin(cfg.style)
    if not isinstance(path, str) or not path:
        raise UserError(f"{where}={path!r} is not an environment: give {style.facts.fn}.")
    return style.build(cfg, path, where)


class Routed:
    """environment.fn as a mapping: the environment a row's `environment` column names, each made
    by its own factory (TRL 1.16's dict environment_factory)."""

    def __init__(self, factories: Mapping[str, Callable[[], Any]]):
        self.factories = dict(factories)

    def __call__(self, row: dict):
        name = row.get(ROUTE_COLUMN)
        if name is None or str(name) not in self.factories:
            shown = "no `environment` column" if name is None else f"environment={name!r}"
            raise UserError(
                f"environment.fn maps {sorted(self.factories)} to environments, and a row has {shown} "
                f"(its prompt: {str(row.get('prompt'))[:80]!r}); give every row an `environment` column "
                "naming one of them (TRL's dict environment_factory reads the same column), or set "
                "environment.fn to one environment."
            )
        return self.factories[str(name)]()

    def samples(self) -> list:
        """One fresh environment of each name (for what they declare: stop strings, metrics), as
        TRL probes one instance of each; the caller closes them."""
        return [make() for make in self.factories.values()]


def check_environment(env) -> list[str]:
    """environment.* (config validation): the style's name (a module of environments/styles/ or an
    import path), one of fn and tools, importable, then the style's own checks. env: the
    environment group (a sampler backend checks that an episode fits it: samplers/vllm.py)."""
    try:
        style = styles.plugin(env.style)
    except UserError as exc:
        return [str(exc)]
    if not env.fn and not env.tools:
        return []
    problems = []
    if not style.facts.tools and not env.fn:
        problems.append(
            f"environment.style={env.style} needs environment.fn, {style.facts.fn}; environment.tools="
            f"{list(env.tools)} are plain functions (the native style)."
        )
    if env.fn and env.tools:
        problems.append(
            f"environment.fn={env.fn!r} and environment.tools={list(env.tools)} are both set; choose one "
            "(an environment of your own, or tools that make the tool environment)."
        )
    if env.max_episode_tokens is not None and env.max_episode_tokens < 1:
        problems.append(f"environment.max_episode_tokens={env.max_episode_tokens} must be >= 1, or null.")
    try:
        environment_factory(env)
    except UserError as exc:
        problems.append(str(exc))
    return problems + style.problems(env)
