"""Held-out evaluation, the one evaluator of grpo-train and grpo-eval: `grade` samples G
completions of each prompt (greedy or with the sampler's settings) and scores them with the
configured rewards; `evaluate` (grpo-train's eval/ metrics) and grpo-eval report from its grades."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_cli.data import Example
from grpo_cli.environments.episodes import episode_metrics
from grpo_cli.errors import UserError
from grpo_cli.rewards import correctness, passes, score_examples
from grpo_cli.rollout import select
from grpo_cli.samplers import draw


@dataclass(frozen=True)
class Graded:
    """One prompt's completions, scored: per completion the weighted total, whether it passes
    (rewards.passes), the correctness reward's value (None: none configured, or not applicable)
    and the completion's length in tokens."""

    example: Example
    totals: list[float]
    passed: list[bool]
    correct: list[float | None]
    lengths: list[int]
    # An environment's episodes: their env/* means (environments.episodes.episode_metrics), else {}.
    env: dict[str, float] = field(default_factory=dict)


def grade(
    sampler,
    tokenizer,
    examples: list[Example],
    rewards,
    *,
    num_generations: int = 1,
    greedy: bool = True,
    prompts_per_call: int = 32,
) -> list[Graded]:
    """Each example's `num_generations` completions from `sampler` (a samplers.Sampler; greedy:
    argmax), `prompts_per_call` prompts to one generate call, scored by `rewards`."""
    judge = correctness(rewards)
    out, G = [], num_generations
    with sampler.sampling():  # (every process, even one with an empty shard: FSDP2 gathers)
        for start in range(0, len(examples), prompts_per_call):
            chunk = examples[start : start + prompts_per_call]
            rollout = draw(sampler, chunk, num_generations=G, greedy=greedy)
            _, total, per_reward = score_examples(rewards, tokenizer, chunk, rollout)
            passed = passes(per_reward, total, judge.name if judge else None)
            correct = per_reward[judge.name] if judge else [None] * len(total)
            lengths = rollout.lengths.tolist()
            for g, ex in enumerate(chunk):
                rows = slice(g * G, (g + 1) * G)
                env = episode_metrics(select(rollout, torch.arange(g * G, (g + 1) * G)))
                out.append(Graded(ex, total[rows], passed[rows], list(correct[rows]), lengths[rows], env))
    return out


def evaluate(
    sampler,
    tokenizer,
    examples: list[Example],
    rewards,
    *,
    batch_size: int = 32,
    reduce=None,
    prefix: str = "eval",
    group_by: str | None = None,
    groups: list[str] = (),
) -> dict[str, float]:
    """`eval/reward` (weighted total) and `eval/accuracy` (mean of the correctness reward, when
    one is configured: rewards.correctness) over the examples, one greedy completion each from `sampler` (a
    samplers.Sampler), `batch_size` prompts at a time.
    With `group_by` (a column) also `eval/accuracy/<value>` for each value in `groups` (the
    same list on every process). `prefix` names the set (eval, eval_wide).
    reduce: sums a list of floats over the processes that evaluate a shard each
    (distributed.Dist.sum): the means are then over every shard."""
    graded = grade(sampler, tokenizer, examples, rewards, prompts_per_call=batch_size)
    totals = [t for g in graded for t in g.totals]
    accuracy = [v for g in graded for v in g.correct if v is not None]
    by_group = {name: [0.0, 0] for name in groups}  # value -> [accuracy sum, count]
    for g in graded:
        group = str(g.example.columns.get(group_by)) if group_by else None
        for v in g.correct:
            if v is not None and group in by_group:
                by_group[group][0] += v
                by_group[group][1] += 1
    sums = [sum(totals), len(totals), sum(accuracy), len(accuracy)]
    sums += [x for name in groups for x in by_group[name]]
    env_names = sorted(graded[0].env) if graded and graded[0].env else []
    sums += [sum(g.env[k] for g in graded) for k in env_names] + [len(graded)] * bool(env_names)
    sums = reduce(sums) if reduce else sums
    reward_sum, reward_n, accuracy_sum, accuracy_n = sums[:4]
    out = {f"{prefix}/reward": reward_sum / max(reward_n, 1)}
    if accuracy_n:
        out[f"{prefix}/accuracy"] = accuracy_sum / accuracy_n
    for i, name in enumerate(groups):
        total, n = sums[4 + 2 * i : 6 + 2 * i]
        if n:
            out[f"{prefix}/accuracy/{name}"] = total / n
    if env_names:  # an environment's episodes (env/tool_call_rate: how often it calls a tool)
        base = 4 + 2 * len(groups)
        for i, k in enumerate(env_names):
            out[f"{prefix}/{k}"] = sums[base + i] / max(sums[base + len(env_names)], 1)
    return out


def group_values(examples: list[Example], column: str | None) -> list[str]:
    """The sorted values of a column over the examples (for evaluate's group_by), [] when absent."""
    if not column:
        return []
    values = sorted({str(ex.columns[column]) for ex in examples if column in ex.columns})
    return values if len(values) <= MAX_GROUPS else []  # a per-row id is no breakdown


MAX_GROUPS = 20


def check_group_by(column: str | None, examples: list[Example], *, default: str | None) -> None:
    """data.eval_group_by must name a column of the held-out rows with at most MAX_GROUPS values,
    or the breakdown would silently be empty. The default (`kind`, the built-in arithmetic's) is
    let pass on data that lacks it: no breakdown then, as for null."""
    if not column or column == default or not examples:
        return
    values = {str(ex.columns[column]) for ex in examples if column in ex.columns}
    if not values:
        known = sorted({k for ex in examples for k in ex.columns})
        raise UserError(
            f"data.eval_group_by={column!r} is not a column of the held-out rows (they have: "
            f"{', '.join(known) or 'no columns besides the prompt'}), so no per-group accuracy could be "
            f"reported: set data.eval_group_by to one of those columns, or null for no breakdown."
        )
    if len(values) > MAX_GROUPS:
        raise UserError(
            f"data.eval_group_by={column!r} has {len(values)} different values in the held-out rows (at most "
            f"{MAX_GROUPS} make a breakdown; a per-row id or a free-text column does not): choose a column "
            "with a few values (a category, a difficulty), or null for no breakdown."
        )
