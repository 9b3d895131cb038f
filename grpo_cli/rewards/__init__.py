"""Reward functions: registry, config resolution and batch scoring.

A reward is a plain function with TRL's signature::

    def my_reward(completions, **kwargs) -> list[float | None]: ...

``kwargs`` holds every dataset column as a list (``answer=[...]``), plus
``prompts`` and ``completion_ids``, plus the reward's own options from YAML.
Rewards must accept and ignore unknown keyword arguments. A function that names a parameter
``completions`` is called as TRL calls rewards, all by keyword (and gets ``trainer_state`` and
``log_metric`` too: _calling.by_keyword, docs/rewards.md).

Completions arrive as TRL passes them (``as_reward_input``): plain strings when
the dataset's prompts are text, and ``[{"role": "assistant", "content": ...}]``
when they are chat messages (then ``prompts`` holds the message lists), so a
reward written for TRL runs unchanged. The built-in rewards read both forms.

Config (``reward`` node, one key per reward)::

    reward:
      accuracy: {weight: 1.0, extract: auto}     # built-in, looked up in REGISTRY
      mine: {weight: 0.5, fn: my_pkg.rewards:score, foo: 3}   # user function

``weight`` defaults to 1.0, ``fn`` is an import path (``package.module:function``
or ``package.module.function``), every other key is an option passed to the
function as a keyword argument.

None rule: a reward may return ``None`` for a sample ("not applicable"). A
``None`` contributes nothing to that sample's weighted total (the other
rewards still count, as with TRL's nansum) and is left out of that reward's
mean/std metrics. A sample for which *every* reward returns ``None`` raises
:class:`RewardError`: a sample with no reward at all is a configuration bug.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo_cli import plugins
from grpo_cli.errors import UserError

from ._calling import names_parameter
from ._common import RewardError, completion_text, preview
from ._text import clean_up_spaces, conversation, decode_completions
from .base import NODE_KEYS, ROLES, Facts, Node, Reward, Rewards, RewardSpec
from .scoring import (
    RESERVED_KWARGS,
    as_reward_input,
    passes,
    reward_metrics,
    score,
    score_examples,
    score_rewards,
)

__all__ = [
    "NODE_KEYS",
    "REGISTRY",
    "ROLES",
    "Facts",
    "Node",
    "Reward",
    "RewardError",
    "RewardSpec",
    "Rewards",
    "as_reward_input",
    "build_rewards",
    "check_reward_columns",
    "check_rewards",
    "clean_up_spaces",
    "completion_text",
    "correctness",
    "conversation",
    "decode_completions",
    "passes",
    "preview",
    "resolve_reward",
    "reward_metrics",
    "score",
    "score_examples",
    "score_rewards",
]


def _builtins() -> dict[str, Reward]:
    """Every built-in: each public module of this package that declares REWARD (a Reward), whose
    name is the module's name, the registry key and the YAML name (plugins.builtin_names, the
    rule of every kind); a module that declares none is the package's machinery (scoring.py)."""
    found = {}
    for name in plugins.builtin_names(__name__):
        declared = getattr(importlib.import_module(f"{__name__}.{name}"), "REWARD", None)
        if isinstance(declared, Reward):
            assert declared.name == name, (name, declared.name)
            found[name] = declared
    return found


#: Built-in rewards, derived from their modules' declarations (name -> Reward).
REGISTRY: dict[str, Reward] = _builtins()
#: The gold-answer column a correctness reward reads unless it sets answer_column.
DEFAULT_ANSWER_COLUMN = REGISTRY["accuracy"].options().answer_column


# --------------------------------------------------------------------------
# resolving
# --------------------------------------------------------------------------


def _import_path_help(name: str) -> str:
    return (
        f"To use your own function, set reward.{name}.fn=package.module:function "
        "(or package.module.function); the module must be importable (installed, or on "
        "PYTHONPATH) and the function must have the signature fn(completions, **kwargs) "
        "-> list[float | None]."
    )


def _resolve_import_path(name: str, path: str) -> Callable:
    if not isinstance(path, str) or not path.strip():
        raise RewardError(
            f"reward {name!r}: fn must be an import path string, got {path!r}. {_import_path_help(name)}"
        )
    path = path.strip()
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    parts = module_name.split(".") + attr_path.split(".")
    if not module_name or not attr_path or not all(part.isidentifier() for part in parts):
        raise RewardError(
            f"reward {name!r}: fn={path!r} is not an import path of the form package.module:function "
            f"or package.module.function. {_import_path_help(name)}"
        )
    try:
        module = plugins.import_user_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise RewardError(
                f"reward {name!r}: fn={path!r}: module {module_name!r} was not found (no module named "
                f"{missing!r}); check the spelling and that it is installed or on PYTHONPATH."
            ) from exc
        raise RewardError(
            f"reward {name!r}: fn={path!r}: module {module_name!r} exists but importing it failed because "
            f"it imports the missing module {missing!r}: {exc}"
        ) from exc
    except Exception as exc:
        raise RewardError(
            f"reward {name!r}: fn={path!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    walked = module_name
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            available = (
                sorted(k for k, v in vars(obj).items() if callable(v) and not k.startswith("_"))
                if hasattr(obj, "__dict__")
                else []
            )
            close = difflib.get_close_matches(attr, available, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            listing = f" Callables there: {', '.join(available[:15])}." if available else ""
            raise RewardError(
                f"reward {name!r}: fn={path!r}: module {module_name!r} was imported but "
                f"{walked!r} has no attribute {attr!r}.{hint}{listing}"
            )
        obj = getattr(obj, attr)
        walked = f"{walked}.{attr}"
    if isinstance(obj, Reward):  # a declaration (with options, checks, a role or a lifecycle)
        return obj
    if not callable(obj) or inspect.ismodule(obj):
        kind = "a module" if inspect.ismodule(obj) else f"a {type(obj).__name__}"
        raise RewardError(
            f"reward {name!r}: fn={path!r} resolves to {kind}, not a callable; "
            "point it at a function (package.module:function) or a grpo_cli.rewards.Reward."
        )
    return obj


def _declared(name: str, found: Any) -> Reward:
    """What an import path gives, as a declaration: a Reward object as it is, a plain function
    wrapped (its `role` attribute, if any, kept)."""
    if isinstance(found, Reward):
        return found
    builtin = next((r for r in REGISTRY.values() if r.fn is found), None)
    if builtin is not None:  # a built-in reached by its path keeps its checks and role
        return dataclasses.replace(builtin, name=name)
    return Reward(name=name, fn=found, role=getattr(found, "role", None) or Facts.role)


def resolve_reward(name: str, fn: str | Callable | Reward | None = None) -> Reward:
    """The declaration of reward ``name``: imported from ``fn`` (an import path to a function or
    to a Reward; a callable or Reward given in Python is taken as it is), else ``REGISTRY[name]``."""
    if isinstance(fn, Reward) or callable(fn):
        return _declared(name, fn)
    if fn is not None:
        return _declared(name, _resolve_import_path(name, fn))
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(str(name), list(REGISTRY), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RewardError(
        f"unknown reward {name!r}; built-in rewards are: {', '.join(sorted(REGISTRY))}.{hint} "
        + _import_path_help(str(name))
    )


# --------------------------------------------------------------------------
# building from config
# --------------------------------------------------------------------------


def correctness(specs: Sequence[RewardSpec]) -> RewardSpec | None:
    """The reward whose role is correctness, if one is configured."""
    return next((spec for spec in specs if spec.role == "correctness"), None)


def _plain(value: Any) -> Any:
    """OmegaConf containers (or any Mapping/Sequence) to plain dicts/lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _signature_problem(fn: Callable) -> str | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # builtins / C functions: cannot check
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return (
            "the function must accept **kwargs (it is called with every dataset column, prompts, "
            "completion_ids and its options as keyword arguments)"
        )
    return None


def _check_calls(problems: list[str], where: str, declared: Reward, workers: Any, timeout: Any) -> bool:
    """Whether a reward's workers and call_timeout_s are usable (else the problems, added)."""
    before = len(problems)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        problems.append(
            f"{where}.workers={workers!r}: give a whole number >= 0 (0: the reward runs in the training "
            "process; N: in a pool of N worker processes)"
        )
    elif workers and (declared.fn is None or inspect.iscoroutinefunction(declared.fn)):
        kind = "is async" if declared.fn is not None else "is built when the run starts (a Reward with build)"
        problems.append(
            f"{where}.workers={workers}: this reward {kind}; worker processes run a plain synchronous "
            f"function given by import path. Remove {where}.workers"
        )
    elif workers and declared.fn is not None and (taken := _process_callables(declared.fn)):
        problems.append(
            f"{where}.workers={workers}: the function takes {' and '.join(taken)}, "
            f"{'an object' if len(taken) == 1 else 'objects'} of the training process that cannot reach "
            f"worker processes. Remove {where}.workers (the reward then runs in the training process), "
            "or drop the parameter"
        )
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0
    ):
        problems.append(
            f"{where}.call_timeout_s={timeout!r}: give a number of seconds > 0 (or leave it unset: no limit)"
        )
    return len(problems) == before


def _process_callables(fn) -> list[str]:
    """What TRL passes that a reward names and that lives in the training process (log_metric,
    log_extra, the episodes' environments): none of it can reach a pool of worker processes."""
    return [name for name in ("log_metric", "log_extra", "environments") if names_parameter(fn, name)]


def _build(reward_cfg: Any) -> tuple[list[RewardSpec], list[str]]:
    specs: list[RewardSpec] = []
    problems: list[str] = []
    if reward_cfg is None or (isinstance(reward_cfg, Mapping) and len(reward_cfg) == 0):
        return specs, [
            "no reward functions configured; add at least one under reward "
            "(e.g. reward: {accuracy: {weight: 1.0}})"
        ]
    if not isinstance(reward_cfg, Mapping):
        return specs, [f"reward must be a mapping of name -> settings, got {type(reward_cfg).__name__}"]
    for name, node in reward_cfg.items():
        where = f"reward.{name}"
        if not isinstance(name, str) or not name:
            problems.append(f"{where}: reward names must be non-empty strings, got {name!r}")
            continue
        if node is None:
            node = {}
        if dataclasses.is_dataclass(
            node
        ):  # a built-in's typed node (config.reward_node), as to_typed gives it
            node = {k: v for k, v in dataclasses.asdict(node).items() if v is not None or k not in NODE_KEYS}
        if not isinstance(node, Mapping):
            problems.append(
                f"{where}: expected a mapping with weight / fn / options, got {node!r} "
                f"(write reward.{name}.weight={node!r} to set the weight)"
            )
            continue
        node = _plain(node)
        weight = node.get("weight", Node.weight)
        weight_ok = (
            isinstance(weight, numbers.Real) and not isinstance(weight, bool) and math.isfinite(weight)
        )
        if not weight_ok:
            problems.append(f"{where}.weight must be a finite number, got {weight!r}")
        options = {k: v for k, v in node.items() if k not in NODE_KEYS}
        for key in options:
            if key in RESERVED_KWARGS:
                problems.append(f"{where}: option name {key!r} is reserved (the engine passes it itself)")
        fn_path = node.get("fn")
        try:
            # A callable or a Reward is accepted too, for configs built in Python.
            declared = resolve_reward(name, fn_path)
        except RewardError as exc:
            message = str(exc)
            prefix = f"reward {name!r}: "
            problems.append(f"{where}: {message[len(prefix) :] if message.startswith(prefix) else message}")
            continue
        if declared.check is not None:
            try:
                problems += [f"{where}: {p}" for p in declared.check(options)]
            except Exception as exc:  # user code: re-raised with its name
                raise RewardError(f"{where}: its option check raised {type(exc).__name__}: {exc}") from exc
        elif declared.fn is not None:
            sig_problem = _signature_problem(declared.fn)
            if sig_problem:
                problems.append(f"{where}: fn={fn_path!r}: {sig_problem}")
        role = node.get("role") or declared.facts.role
        workers, timeout = node.get("workers") or Node.workers, node.get("call_timeout_s")
        calls_ok = _check_calls(problems, where, declared, workers, timeout)
        if role not in ROLES:
            problems.append(f"{where}.role={role!r}: choose one of {', '.join(ROLES)}")
        elif weight_ok and calls_ok:
            specs.append(
                RewardSpec(
                    name=name,
                    reward=declared,
                    weight=float(weight),
                    options=options,
                    role=role,
                    workers=workers,
                    call_timeout_s=None if timeout is None else float(timeout),
                )
            )
    judges = [spec.name for spec in specs if spec.role == "correctness"]
    if len(judges) > 1:
        problems.append(
            f"rewards {', '.join(judges)} all have role correctness, but one reward decides whether a "
            f"completion is right (eval/accuracy, the pass rule): set reward.<name>.role=shaping on all but one"
        )
    return specs, problems


def check_rewards(reward_cfg: Mapping[str, Mapping]) -> list[str]:
    """Every problem in a reward config, as strings (empty list: config is fine)."""
    return _build(reward_cfg)[1]


def build_rewards(reward_cfg: Mapping[str, Mapping], *, none_ok: bool = False) -> Rewards:
    """The rewards of a config (not yet opened: Rewards.open builds those with a build); raises
    one RewardError listing every problem. none_ok: no reward at all is fine (pure on-policy
    distillation: the teacher alone trains)."""
    if none_ok and not reward_cfg:
        return Rewards([])
    specs, problems = _build(reward_cfg)
    if problems:
        raise RewardError(
            f"invalid reward configuration ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return Rewards(specs)


def check_reward_columns(rewards: Sequence[RewardSpec], rows: list[dict], data_cfg: Any) -> None:
    """The correctness reward (accuracy's, or one of yours with that role) needs a gold answer per
    prompt, and a reward that declares the columns it reads (Reward.columns) needs them: check
    before any model loads."""
    for spec in rewards:
        if spec.role != "correctness":
            continue
        column = spec.answer_column
        where = f"data.path={data_cfg.path!r}" if data_cfg.source != "arithmetic" else "the arithmetic data"
        if rows and not any(column in row for row in rows):
            raise UserError(
                f"reward.{spec.name} needs the gold answer of each prompt, but {where} has no column "
                f"{column!r} (columns: {', '.join(map(str, rows[0]))}). Set reward.{spec.name}.answer_column "
                f"to the column that holds the answers, or drop the {spec.name} reward."
            )
        for row in rows:
            if row.get(column) is None:
                prompt = str(row.get(data_cfg.prompt_column))[:60]
                raise UserError(
                    f"reward.{spec.name} needs the gold answer of each prompt, but a record of {where} has no "
                    f"{column!r} (prompt {prompt!r}); add its answer or remove that record."
                )
    for spec in rewards:  # rows a reward cannot score (text answers for the math accuracy)
        if spec.reward.facts.check_rows is not None and rows:
            problems = spec.reward.facts.check_rows(rows, spec.options)
            if problems:
                raise UserError(" ".join(problems))
    for spec in rewards:  # the columns a reward reads (a judge's template: Reward.columns)
        columns = spec.reward.facts.columns
        if columns is None or not rows:
            continue
        where = f"data.path={data_cfg.path!r}" if data_cfg.source != "arithmetic" else "the arithmetic data"
        missing = [c for c in columns(spec.options) if not any(c in row for row in rows)]
        if missing:
            raise UserError(
                f"reward.{spec.name} reads the column{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(repr, missing))}, which {where} does not have (columns: "
                f"{', '.join(map(str, rows[0]))}). Name a column the data has (a judge's template: "
                f"{{answer}} reads the column answer), or add the column to the data."
            )
