"""Scoring: completions -> the rewards' values and their weighted totals.

`score_rewards` calls every reward once on a batch (the None rule and the errors are in
rewards/__init__.py's docstring); `score_examples` scores a rollout whose rows are G completions
per example (training, grpo-train's evaluation and grpo-eval all score through it);
`decode_completions` is the text the rewards see; `passes` is the one pass rule.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_cli.calls import call_with_timeout

from ._calling import by_keyword, invoke, names_parameter
from ._common import RewardError, preview
from ._text import conversation, decode_completions
from .base import RewardSpec

if TYPE_CHECKING:
    from grpo_cli.data import Example

#: What TRL passes every reward beyond grpo-cli's own keywords: a reward called by keyword gets
#: trainer_state, log_metric(name, value) (a scalar in the step's metrics.jsonl row, the mean of
#: the step's values) and log_extra(column, values) (one value per completion of the call: a
#: column of completions.jsonl, under "extra").
TRL_ONLY_KWARGS = ("trainer_state", "log_metric", "log_extra")

#: Keyword arguments the engine passes itself; options may not use these names.
RESERVED_KWARGS = ("completions", "prompts", "completion_ids", "env_reward", "environments", *TRL_ONLY_KWARGS)


@dataclass
class Logs:
    """What rewards called by keyword log through TRL's callables during scoring: log_metric's
    values by name (metrics) and log_extra's columns, one value per completion (extra)."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerProgress:
    """What TRL passes a reward as `trainer_state` (its transformers.TrainerState), the fields a
    reward shaped by training progress reads: the optimizer steps done (`global_step`; 0 before
    the first, and in grpo-eval) and the run's trainer.max_steps (`max_steps`)."""

    global_step: int = 0
    max_steps: int = 0


def _row_kwargs(kwargs: Mapping[str, Any], data_keys: Sequence[str], i: int) -> dict[str, Any]:
    single = dict(kwargs)
    for key in [*data_keys, "environments"]:
        value = kwargs.get(key)
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
            invoke(spec.fn, [completions[i]], _row_kwargs(kwargs, data_keys, i))
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


def _hung(spec: RewardSpec, exc: BaseException) -> RewardError:
    return RewardError(
        f"reward {spec.name!r} did not return in time: {exc}. A reward that hangs (a server that never "
        "answers, a verifier stuck on one input) would freeze the run, so it stops here. Fix the "
        f"reward, or raise reward.{spec.name}.call_timeout_s if its calls are just slow."
    )


def _metric_logger(logs: Logs | None) -> Callable[[str, float], None]:
    """TRL's log_metric(name, value): a scalar for the step's metrics (the mean of a step's values)."""

    def log_metric(name: str, value: float) -> None:
        if logs is not None:
            logs.metrics.setdefault(str(name), []).append(float(value))

    return log_metric


def _extra_logger(logs: Logs | None, n: int, name: str) -> Callable[[str, list], None]:
    """TRL's log_extra(column, values): one value per completion of the call (n), a column of the
    logged completions."""

    def log_extra(column: str, values: list) -> None:
        values = list(values)
        if len(values) != n:
            raise RewardError(
                f"reward {name!r} called log_extra({column!r}, ...) with {len(values)} values for the {n} "
                "completions it was given; give one value per completion."
            )
        if logs is not None:
            logs.extra[str(column)] = values

    return log_extra


def _call(spec: RewardSpec, completions: list, kwargs: dict, data_keys: list[str]):
    """One reward's call on the batch: its value list, or an awaitable (an async reward). In a
    pool of worker processes, one call per completion (reward.<name>.workers); else in this
    process, at most reward.<name>.call_timeout_s seconds when that is set."""
    if spec.pool is not None:
        return spec.pool(completions, [_row_kwargs(kwargs, data_keys, i) for i in range(len(completions))])
    what = f"reward {spec.name!r}"
    return call_with_timeout(
        invoke, (spec.fn, completions, kwargs), spec.call_timeout_s, what, "call_timeout_s"
    )


async def _timed(awaitable, timeout_s: float | None):
    tick = time.perf_counter()
    value = await (asyncio.wait_for(awaitable, timeout_s) if timeout_s else awaitable)
    return value, time.perf_counter() - tick


def _add(stats: dict | None, key: str, value: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0.0) + value


def _chat_hint(exc: Exception, completions: list) -> str:
    """The hint for a reward written for chat messages that was given plain strings."""
    if isinstance(exc, TypeError) and "string indices" in str(exc) and isinstance(completions[0], str):
        return (
            " The completions are plain strings because the prompts are plain text; a reward that "
            'reads completion[0]["content"] is written for chat messages (TRL\'s conversational '
            "format), which grpo-cli passes when the dataset's prompts are chat messages. Read "
            "the string, or give chat prompts."
        )
    return ""


def _await(waiting: list[RewardSpec], results: dict[str, Any], stats: dict | None) -> None:
    """The async rewards' calls (results[name]: awaitables) awaited together on the reward loop
    (rewards/aio.py); results[name] becomes each one's values, its seconds added to stats."""
    from . import aio

    for spec, outcome in zip(waiting, aio.gather([results[spec.name] for spec in waiting])):
        if isinstance(outcome, TimeoutError):
            raise _hung(spec, outcome) from None
        if isinstance(outcome, RewardError):
            raise outcome
        if isinstance(outcome, BaseException):
            raise RewardError(
                f"reward {spec.name!r} (async) raised {type(outcome).__name__}: {outcome}"
            ) from outcome
        results[spec.name], seconds = outcome
        _add(stats, f"time/rewards/{spec.name}", seconds)


def score_rewards(
    specs: Sequence[RewardSpec],
    completions: list,
    *,
    prompts: list,
    completion_ids: list | None,
    columns: Mapping[str, list],
    env_reward: list | None = None,
    environments: list | None = None,
    stats: dict[str, float] | None = None,
    progress: TrainerProgress | None = None,
    logs: Logs | None = None,
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Call every reward once on the batch; return (weighted totals, raw values per reward).

    See the module docstring for the None rule. Any failure raises RewardError
    naming the reward and, where it can be found, the completion at fault. The async rewards
    (a call that returns an awaitable) run together on the reward loop (rewards/aio.py), after the
    synchronous ones have returned. A NaN from a reward declared nan_ok (a judge that failed under
    on_error=nan) makes the completion's total NaN: its group is then left out of the loss.
    `stats`, when given, gains per reward time/rewards/<name> (seconds), rewards/<name>/failures
    (its NaNs) and the counters of its pop_metrics(). A reward called by keyword (TRL's form,
    by_keyword) also gets `trainer_state` (`progress`) and, in this process, `log_metric` and
    `log_extra`, whose values `logs` gains. A reward that names `environments` gets the episodes'
    environment objects (TRL's keyword; `environments`, one per completion, open until scored).
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
    engine = {"prompts": prompts, "completion_ids": completion_ids}
    if env_reward is not None:  # an environment's episodes: its own reward, None where it gave none
        engine["env_reward"] = env_reward
    data_keys = [*columns, *engine]
    results: dict[str, Any] = {}
    waiting: list[RewardSpec] = []
    for spec in specs:
        clash = sorted(set(spec.options) & set(columns))
        if clash:
            raise RewardError(
                f"reward {spec.name!r}: option(s) {', '.join(clash)} have the same name as dataset column(s); "
                "rename the option or the column"
            )
        kwargs = {**columns, **engine, **spec.options}
        if names_parameter(spec.fn, "environments"):  # (only to those that name it: never pickled)
            if environments is None:
                raise RewardError(
                    f"reward {spec.name!r} takes `environments` (TRL's keyword: each episode's environment "
                    "object), and this run has no environment; choose one (environment.fn=..., "
                    "environment.style=trl), or drop the parameter."
                )
            kwargs["environments"] = environments
        if by_keyword(spec.fn):  # TRL's call: what TRL passes beyond grpo-cli's keywords
            kwargs["trainer_state"] = progress or TrainerProgress()
            if spec.pool is None:  # (a callable cannot reach worker processes: check_rewards refuses)
                kwargs["log_metric"] = _metric_logger(logs)
                kwargs["log_extra"] = _extra_logger(logs, n, spec.name)
        tick = time.perf_counter()
        try:
            result = _call(spec, completions, kwargs, data_keys)
        except TimeoutError as exc:
            raise _hung(spec, exc) from None
        except Exception as exc:
            where = (
                _locate_failure(spec, completions, kwargs, data_keys, columns) if spec.pool is None else ""
            )
            raise RewardError(
                f"reward {spec.name!r} raised {type(exc).__name__}: {exc}.{where}{_chat_hint(exc, completions)}"
            ) from exc
        if inspect.isawaitable(result):
            waiting.append(spec)
            results[spec.name] = _timed(result, spec.call_timeout_s)
        else:
            _add(stats, f"time/rewards/{spec.name}", time.perf_counter() - tick)
            results[spec.name] = result
    if waiting:
        _await(waiting, results, stats)
    per_reward: dict[str, list[float | None]] = {}
    for spec in specs:
        per_reward[spec.name] = _column(spec, results[spec.name], completions, columns)
        _add(
            stats,
            f"rewards/{spec.name}/failures",
            sum(v is not None and math.isnan(v) for v in per_reward[spec.name]),
        )
        pop = getattr(spec.fn, "pop_metrics", None)
        for key, value in (pop() if callable(pop) else {}).items():
            if key != "failures":  # (counted above, as its NaNs)
                _add(stats, f"rewards/{spec.name}/{key}", float(value))
    return _totals(specs, per_reward, completions, columns), per_reward


def _column(spec: RewardSpec, result, completions: list, columns: Mapping[str, list]) -> list[float | None]:
    """One reward's returned values checked (a list, one number or None per completion, finite
    unless it may fail: Reward.nan_ok) and made floats."""
    n = len(completions)
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
        failed = number is not None and math.isnan(number) and spec.reward.nan_ok
        if number is not None and not math.isfinite(number) and not failed:
            raise RewardError(
                f"reward {spec.name!r} returned {number!r} (not finite) for completion index {i}: "
                f"{preview(completions[i])}{_row_columns(columns, i)}"
            )
        column.append(number)
    return column


def _totals(
    specs: Sequence[RewardSpec],
    per_reward: Mapping[str, list],
    completions: list,
    columns: Mapping[str, list],
) -> list[float]:
    """Each completion's weighted total over the rewards that apply to it (not None)."""
    n = len(completions)
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
    return totals


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
        present = [float(v) for v in values if v is not None and not math.isnan(v)]  # (NaN: failed)
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


def score_examples(
    rewards,
    tokenizer,
    examples: list[Example],
    drawn,
    stats: dict | None = None,
    progress: TrainerProgress | None = None,
    logs: Logs | None = None,
):
    """Rewards of a draw (rollout.Drawn: the rollout, and beside it the reset prompts and open
    environments the rewards may read) whose rows are num_generations completions per example, in
    order; returns (the completions' texts, weighted totals, values per reward). `stats`,
    `progress`, `logs`: as in score_rewards."""
    rollout, reset_prompts = drawn.rollout, drawn.reset_prompts
    num_generations = rollout.num_generations
    texts = decode_completions(tokenizer, rollout.completion_ids, rollout.attention_mask)
    columns: dict[str, list] = {}
    for ex in examples:
        for key, value in ex.columns.items():
            columns.setdefault(key, []).extend([value] * num_generations)
    prompts = [ex.prompt for ex in examples for _ in range(num_generations)]
    # The rewards see each episode's prompt as its environment's reset made it (TRL's `prompts`
    # after reset); the form of the completions follows the example's own prompt.
    shown = [p if r is None else r for p, r in zip(prompts, reset_prompts or [None] * len(prompts))]
    completion_ids = [
        ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.attention_mask)
    ]
    if not rollout.is_episode:
        completions = [as_reward_input(prompt, text) for prompt, text in zip(prompts, texts)]
    else:  # an environment's episodes: the whole conversation (TRL's conversational completions)
        completions = [
            conversation(tokenizer, ids, roles) if isinstance(prompt, list) else text
            for prompt, text, ids, roles in zip(prompts, texts, rollout.completion_ids, rollout.roles)
        ]
    env_reward = None
    if rollout.is_episode:
        env_reward = [None if math.isnan(v) else v for v in rollout.env_reward.tolist()]
    total, per_reward = score_rewards(
        rewards,
        completions,
        prompts=shown,
        completion_ids=completion_ids,
        columns=columns,
        env_reward=env_reward,
        environments=list(drawn.environments) or None,
        stats=stats,
        progress=progress,
        logs=logs,
    )
    return texts, total, per_reward


def score(rewards, tokenizer, examples: list[Example], drawn, progress: TrainerProgress | None = None):
    """A draw (rollout.Drawn) whose rows are num_generations completions per example, in order,
    scored into one frozen record (scored.Scored): every reward's value, the weighted totals, the
    pass rule and the accuracy rule's rows, the rows' prompts (indices into `examples`), and the
    call's per-reward time, counters, log_metric values and log_extra columns. `progress`: the
    rewards' trainer_state. (RolloutPath.score calls this, then closes the draw's environments.)"""
    import torch

    from grpo_cli.scored import Scored

    rollout = drawn.rollout
    counters: dict[str, float] = {}
    logs = Logs()
    if len(rewards):
        _, totals, per_reward = score_examples(
            rewards, tokenizer, examples, drawn, stats=counters, progress=progress, logs=logs
        )
    else:  # no reward at all (on-policy distillation alone: the teacher trains): every total 0
        totals, per_reward = [0.0] * rollout.completion_ids.shape[0], {}
    judge = next((spec.name for spec in rewards if spec.role == "correctness"), None)
    device, N = rollout.completion_ids.device, len(totals)
    values = [[math.nan if v is None else v for v in column] for column in per_reward.values()]  # [R][N]
    return Scored(
        rollout=rollout,
        names=tuple(per_reward),
        values=torch.tensor(values, dtype=torch.float64, device=device).reshape(len(values), N).T,
        totals=torch.tensor(totals, dtype=torch.float64, device=device),
        passed=torch.tensor(passes(per_reward, totals, judge), dtype=torch.bool, device=device),
        applies=torch.tensor(
            [True] * N if judge is None else [v is not None for v in per_reward[judge]],
            dtype=torch.bool,
            device=device,
        ),
        prompt_index=torch.arange(len(examples), device=device).repeat_interleave(rollout.num_generations),
        counters=counters,
        logged={name: tuple(v) for name, v in logs.metrics.items()},
        extra={name: tuple(v) for name, v in logs.extra.items()},
        weights=tuple(float(spec.weight) for spec in rewards),
    )
