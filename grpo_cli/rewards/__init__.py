"""Reward functions: registry, config resolution and batch scoring.

A reward is a plain function with TRL's signature::

    def my_reward(completions, **kwargs) -> list[float | None]: ...

``kwargs`` holds every dataset column as a list (``answer=[...]``), plus
``prompts`` and ``completion_ids``, plus the reward's own options from YAML.
Rewards must accept and ignore unknown keyword arguments.

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
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The submodules stay reachable as grpo_cli.rewards.accuracy / .format / .length
# (module name = registry key = YAML name); their functions are not re-bound
# here so the package attributes keep pointing at the modules.
from . import accuracy, format, length  # noqa: A004 - `format` shadows the builtin only in this module
from ._common import RewardError, completion_text, preview
from .format import format_reward

__all__ = [
    "REGISTRY",
    "RewardError",
    "RewardSpec",
    "as_reward_input",
    "build_rewards",
    "check_rewards",
    "correctness",
    "completion_text",
    "resolve_reward",
    "passes",
    "reward_metrics",
    "score_rewards",
    "accuracy",
    "format",
    "format_reward",
    "length",
]

#: Built-in rewards; the key is the module name and the YAML name.
REGISTRY: dict[str, Callable[..., list]] = {
    "accuracy": accuracy.accuracy,
    "format": format.format_reward,
    "length": length.length,
}

#: Option checks of the built-ins, keyed by function (so a built-in reached
#: through ``fn=grpo_cli.rewards.length:length`` under another name is checked too).
_OPTION_CHECKS: dict[Callable[..., list], Callable[..., list[str]]] = {
    accuracy.accuracy: accuracy.check_options,
    format.format_reward: format.check_options,
    length.length: length.check_options,
}

#: What a reward is for. correctness: it says whether a completion is right (1.0 = right), so it
#: drives eval/accuracy, the pass rule (pass@k, pass_rate_hist) and the check that the data has
#: its answer column; at most one reward has it. shaping: any other (format, length, ...).
#: A built-in declares its own (its module's ROLE); a function of yours may carry a `role`
#: attribute, and `reward.<name>.role` sets it in YAML.
ROLES = ("correctness", "shaping")
_BUILTIN_ROLES: dict[Callable[..., list], str] = {
    accuracy.accuracy: accuracy.ROLE,
    format.format_reward: format.ROLE,
    length.length: length.ROLE,
}
#: The gold-answer column a correctness reward reads unless it sets answer_column.
DEFAULT_ANSWER_COLUMN = accuracy.Options().answer_column

#: Keyword arguments the engine passes itself; options may not use these names.
RESERVED_KWARGS = ("completions", "prompts", "completion_ids")
_NODE_KEYS = ("weight", "fn", "role")


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
        module = importlib.import_module(module_name)
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
    if not callable(obj) or inspect.ismodule(obj):
        kind = "a module" if inspect.ismodule(obj) else f"a {type(obj).__name__}"
        raise RewardError(
            f"reward {name!r}: fn={path!r} resolves to {kind}, not a callable; "
            "point it at a function (package.module:function)."
        )
    return obj


def resolve_reward(name: str, fn: str | None = None) -> Callable:
    """The reward function for ``name``: imported from ``fn`` if given, else ``REGISTRY[name]``."""
    if fn is not None:
        return _resolve_import_path(name, fn)
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


@dataclass
class RewardSpec:
    """One configured reward: its YAML name, function, weight, options and role (ROLES)."""

    name: str
    fn: Callable
    weight: float
    options: dict = field(default_factory=dict)
    role: str = "shaping"

    @property
    def answer_column(self) -> str:
        """The dataset column with the gold answers (a correctness reward's)."""
        return self.options.get("answer_column", DEFAULT_ANSWER_COLUMN)


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
            node = {k: v for k, v in dataclasses.asdict(node).items() if v is not None or k not in _NODE_KEYS}
        if not isinstance(node, Mapping):
            problems.append(
                f"{where}: expected a mapping with weight / fn / options, got {node!r} "
                f"(write reward.{name}.weight={node!r} to set the weight)"
            )
            continue
        node = _plain(node)
        weight = node.get("weight", 1.0)
        weight_ok = (
            isinstance(weight, numbers.Real) and not isinstance(weight, bool) and math.isfinite(weight)
        )
        if not weight_ok:
            problems.append(f"{where}.weight must be a finite number, got {weight!r}")
        options = {k: v for k, v in node.items() if k not in _NODE_KEYS}
        for key in options:
            if key in RESERVED_KWARGS:
                problems.append(f"{where}: option name {key!r} is reserved (the engine passes it itself)")
        fn_path = node.get("fn")
        try:
            # A callable is accepted too, for configs built in Python.
            fn = fn_path if callable(fn_path) else resolve_reward(name, fn_path)
        except RewardError as exc:
            message = str(exc)
            prefix = f"reward {name!r}: "
            problems.append(f"{where}: {message[len(prefix) :] if message.startswith(prefix) else message}")
            continue
        checker = next((check for builtin, check in _OPTION_CHECKS.items() if builtin is fn), None)
        if checker is not None:
            problems += [f"{where}: {p}" for p in checker(options)]
        else:
            sig_problem = _signature_problem(fn)
            if sig_problem:
                problems.append(f"{where}: fn={fn_path!r}: {sig_problem}")
        role = node.get("role") or getattr(fn, "role", None) or _BUILTIN_ROLES.get(fn, "shaping")
        if role not in ROLES:
            problems.append(f"{where}.role={role!r}: choose one of {', '.join(ROLES)}")
        elif weight_ok:
            specs.append(RewardSpec(name=name, fn=fn, weight=float(weight), options=options, role=role))
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


def build_rewards(reward_cfg: Mapping[str, Mapping]) -> list[RewardSpec]:
    """RewardSpecs for a reward config; raises one RewardError listing every problem."""
    specs, problems = _build(reward_cfg)
    if problems:
        raise RewardError(
            f"invalid reward configuration ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return specs


# --------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------


def _row_kwargs(kwargs: Mapping[str, Any], data_keys: Sequence[str], i: int) -> dict[str, Any]:
    single = dict(kwargs)
    for key in data_keys:
        value = kwargs[key]
        if value is not None:
            single[key] = [value[i]]
    return single


def _row_columns(columns: Mapping[str, list], i: int, limit: int = 60) -> str:
    if not columns:
        return ""
    shown = ", ".join(f"{k}={preview(str(v[i]), limit)}" for k, v in columns.items())
    return f" (row: {shown})"


def _locate_failure(
    spec: RewardSpec, completions: list, kwargs: dict, data_keys: list[str], columns: Mapping[str, list]
) -> str:
    """Re-call the reward on single completions to find which ones fail."""
    failing: list[tuple[int, BaseException]] = []
    for i in range(len(completions)):
        try:
            spec.fn([completions[i]], **_row_kwargs(kwargs, data_keys, i))
        except Exception as exc:  # noqa: BLE001 - we only locate; the original is re-raised
            failing.append((i, exc))
    n = len(completions)
    if not failing:
        return " Called on each completion alone it does not fail, so the failure depends on the whole batch."
    if len(failing) == n and n > 1:
        i, exc = failing[0]
        return (
            f" It fails on every completion when called alone (first: {type(exc).__name__}: {exc}), "
            "so the cause is not one sample."
        )
    i, exc = failing[0]
    more = f" ({len(failing)} of {n} completions fail; first shown)" if len(failing) > 1 else ""
    return (
        f" It fails on completion index {i} of {n}{more}: {preview(completions[i])}"
        f"{_row_columns(columns, i)}; called alone it raises {type(exc).__name__}: {exc}"
    )


def _as_float(value: Any) -> float | None:
    """A reward value as float, None for None; raises TypeError/ValueError if not numeric."""
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError("not a number")
    return float(value)  # numpy / 0-d torch scalars


def score_rewards(
    specs: Sequence[RewardSpec],
    completions: list,
    *,
    prompts: list,
    completion_ids: list | None,
    columns: Mapping[str, list],
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Call every reward once on the batch; return (weighted totals, raw values per reward).

    See the module docstring for the None rule. Any failure raises RewardError
    naming the reward and, where it can be found, the completion at fault.
    """
    n = len(completions)
    if not specs:
        raise RewardError("no reward functions configured; nothing to score completions with")
    for key, values in [("prompts", prompts), ("completion_ids", completion_ids), *columns.items()]:
        if values is not None and len(values) != n:
            raise RewardError(f"{key!r} has {len(values)} values for {n} completions")
    for key in columns:
        if key in RESERVED_KWARGS:
            raise RewardError(
                f"dataset column {key!r} clashes with a reward argument the engine passes; rename the column"
            )
    data_keys = [*columns, "prompts", "completion_ids"]
    per_reward: dict[str, list[float | None]] = {}
    for spec in specs:
        clash = sorted(set(spec.options) & set(columns))
        if clash:
            raise RewardError(
                f"reward {spec.name!r}: option(s) {', '.join(clash)} have the same name as dataset column(s); "
                "rename the option or the column"
            )
        kwargs = {**columns, "prompts": prompts, "completion_ids": completion_ids, **spec.options}
        try:
            result = spec.fn(completions, **kwargs)
        except Exception as exc:
            where = _locate_failure(spec, completions, kwargs, data_keys, columns)
            if (
                isinstance(exc, TypeError)
                and "string indices" in str(exc)
                and isinstance(completions[0], str)
            ):
                where += (
                    " The completions are plain strings because the prompts are plain text; a reward that "
                    'reads completion[0]["content"] is written for chat messages (TRL\'s conversational '
                    "format), which grpo-cli passes when the dataset's prompts are chat messages. Read "
                    "the string, or give chat prompts."
                )
            raise RewardError(f"reward {spec.name!r} raised {type(exc).__name__}: {exc}.{where}") from exc
        is_list_like = hasattr(result, "__len__") and hasattr(result, "__iter__")
        if isinstance(result, (str, bytes, Mapping)) or not is_list_like:
            raise RewardError(
                f"reward {spec.name!r} returned {type(result).__name__} {result!r:.80}; it must return a list "
                f"with one float (or None) per completion ({n} completions)"
            )
        values = list(result)
        if len(values) != n:
            raise RewardError(
                f"reward {spec.name!r} returned {len(values)} values for {n} completions; it must return "
                f"exactly one float (or None) per completion, in order (returned: {values!r:.120})"
            )
        column: list[float | None] = []
        for i, value in enumerate(values):
            try:
                number = _as_float(value)
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward {spec.name!r} returned a non-numeric value {value!r:.80} "
                    f"(type {type(value).__name__}) for completion index {i}: {preview(completions[i])}"
                    f"{_row_columns(columns, i)}"
                ) from None
            if number is not None and not math.isfinite(number):
                raise RewardError(
                    f"reward {spec.name!r} returned {number!r} (not finite) for completion index {i}: "
                    f"{preview(completions[i])}{_row_columns(columns, i)}"
                )
            column.append(number)
        per_reward[spec.name] = column

    totals: list[float] = []
    for i in range(n):
        applicable = [
            (spec.weight, per_reward[spec.name][i]) for spec in specs if per_reward[spec.name][i] is not None
        ]
        if not applicable:
            raise RewardError(
                f"every reward ({', '.join(s.name for s in specs)}) returned None for completion index {i}: "
                f"{preview(completions[i])}{_row_columns(columns, i)}; a sample with no applicable reward "
                "is a configuration bug (add a reward that covers it or fix the data)"
            )
        totals.append(float(sum(w * v for w, v in applicable)))
    return totals, per_reward


def as_reward_input(prompt, text: str):
    """A completion as the reward functions receive it, in TRL's convention: when the prompt is
    chat messages (a conversational dataset), the completion is a message list
    `[{"role": "assistant", "content": text}]`, so a reward written for TRL
    (`completion[0]["content"]`) runs unchanged; when the prompt is plain text, the text itself.
    The built-in rewards read both (rewards.completion_text)."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def reward_metrics(per_reward: Mapping[str, Sequence[float | None]]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``rewards/<name>/std`` over the non-None values.

    std is the population std (ddof=0). A reward that was None for the whole
    batch gets NaN for both.
    """
    metrics: dict[str, float] = {}
    for name, values in per_reward.items():
        present = [float(v) for v in values if v is not None]
        if present:
            mean, std = statistics.fmean(present), statistics.pstdev(present)
        else:
            mean = std = float("nan")
        metrics[f"rewards/{name}/mean"] = mean
        metrics[f"rewards/{name}/std"] = std
    return metrics


def passes(
    per_reward: Mapping[str, Sequence[float | None]], totals: Sequence[float], judge: str | None
) -> list[bool]:
    """Whether each completion passes: the correctness reward (its name: `judge`, see
    `correctness`) is 1 when one is configured, else the weighted total reward is > 0. The one
    pass rule of the training metrics (pass_rate_hist) and grpo-eval (pass@1, pass@G, greedy
    accuracy)."""
    if judge is not None and judge in per_reward:
        return [v is not None and v >= 1.0 for v in per_reward[judge]]
    return [t > 0 for t in totals]
