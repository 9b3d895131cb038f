"""Held-out evaluation, the one evaluator of grpo-train and grpo-eval: `grade` samples G
completions of each prompt (greedy or with the sampler's settings) and scores them with the
configured rewards; `evaluate` (grpo-train's eval/ metrics) and grpo-eval report from its grades."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch

from grpo_cli.data import Example
from grpo_cli.environments.episodes import episode_metrics
from grpo_cli.environments.path import RolloutPath
from grpo_cli.errors import UserError
from grpo_cli.rewards import correctness
from grpo_cli.rollout import select as select_rollout
from grpo_cli.scored import Scored, concat


def grade(
    path: RolloutPath,
    tokenizer,
    examples: list[Example],
    rewards,
    *,
    num_generations: int = 1,
    greedy: bool = True,
    prompts_per_call: int = 32,
    seeds: list[int] | None = None,
    temperature: float | None = None,
) -> Scored | None:
    """Each example's `num_generations` completions (or episodes) drawn by `path` (its sampler's
    settings, or greedy: argmax), `prompts_per_call` prompts to one draw, scored by `rewards` into one record
    (scored.Scored: rows in example order, prompt_index into `examples`); None without examples.
    seeds: each example's sampling seed (sampled draws that must not depend on the chunking or
    the process count: pass_rates); None: the sampler's own. temperature: the sampled draws'
    (None: the sampler's sampler.temperature)."""
    parts, G = [], num_generations
    with path.sampler.sampling():  # (every process, even one with an empty shard: FSDP2 gathers)
        for start in range(0, len(examples), prompts_per_call):
            chunk = examples[start : start + prompts_per_call]
            chunk_seeds = None if seeds is None else seeds[start : start + prompts_per_call]
            drawn = path.draw_for_scoring(
                chunk, seeds=chunk_seeds, num_generations=G, greedy=greedy, temperature=temperature
            )
            scored = path.score(drawn, chunk, rewards, tokenizer)
            parts.append(replace(scored, prompt_index=scored.prompt_index + start))
    return concat(parts, tokenizer.pad_token_id) if parts else None


def env_means(graded: Scored | None) -> tuple[list[str], list[float]]:
    """An environment's episode metrics (environments.episodes.episode_metrics), each prompt's
    mean over its group, summed over the prompts: (their names, the sums). Nothing for single-turn."""
    if graded is None or not graded.rollout.is_episode:
        return [], []
    G = graded.num_generations
    per_prompt = [
        episode_metrics(select_rollout(graded.rollout, torch.arange(g * G, (g + 1) * G)))
        for g in range(len(graded.totals) // G)
    ]
    names = sorted(per_prompt[0])
    return names, [sum(m[k] for m in per_prompt) for k in names]


def evaluate(
    path: RolloutPath,
    tokenizer,
    examples: list[Example],
    rewards,
    *,
    batch_size: int = 32,
    reduce=None,
    prefix: str = "eval",
    group_by: str | None = None,
    groups: list[str] = (),
    samples: int = 0,
    seeds: list[int] | None = None,
    temperature: float | None = None,
) -> dict[str, float]:
    """`eval/reward` (weighted total) and `eval/accuracy` (the accuracy rule, Scored.accuracy:
    the share of the rows the correctness reward applies to that pass; only when a correctness
    reward is configured: rewards.correctness) over the examples, one greedy completion each
    drawn by `path`, `batch_size` prompts at a time.
    With `group_by` (a column) also `eval/accuracy/<value>` for each value in `groups` (the
    same list on every process). `prefix` names the set (eval, eval_wide).
    reduce: sums a list of floats over the processes that evaluate a shard each
    (distributed.Dist.sum): the means are then over every shard.
    samples k >= 1: `samples` completions of each prompt with the sampler's settings, at
    `temperature` where given (trainer.eval_temperature; seeds: each prompt's sampling seed),
    instead of one greedy one, reported as `<prefix>/pass@1` (the accuracy rule over the sampled
    rows) and `<prefix>/pass@k` (the share of prompts with a counted row that passes), per group
    too; no `<prefix>/accuracy` nor `<prefix>/reward` (those names are greedy's)."""
    if samples:
        graded = grade(
            path,
            tokenizer,
            examples,
            rewards,
            num_generations=samples,
            greedy=False,
            prompts_per_call=max(1, batch_size // samples),
            seeds=seeds,
            temperature=temperature,
        )
        return _sampled_metrics(graded, examples, rewards, reduce, prefix, group_by, groups, samples)
    graded = grade(path, tokenizer, examples, rewards, prompts_per_call=batch_size)
    judged = correctness(rewards) is not None
    totals = graded.totals.tolist() if graded is not None else []
    passed, counted = graded.accuracy() if graded is not None else (0, 0)
    by_group = group_accuracy(graded, examples, group_by, groups) if graded is not None and group_by else {}
    env_names, env_sums = env_means(graded)
    sums = [sum(totals), len(totals), passed, counted]
    for name in groups:  # (rows that pass, rows counted) of each group, zeros without a grade
        group = by_group.get(name, GroupAccuracy(0, 0, 0, 0))
        sums += [group.passed, group.counted]
    sums += env_sums + [len(totals) // max(graded.num_generations, 1) if graded else 0] * bool(env_names)
    sums = reduce(sums) if reduce else sums
    reward_sum, reward_n, accuracy_sum, accuracy_n = sums[:4]
    out = {f"{prefix}/reward": reward_sum / max(reward_n, 1)}
    if judged and accuracy_n:
        out[f"{prefix}/accuracy"] = accuracy_sum / accuracy_n
    for i, name in enumerate(groups):
        total, n = sums[4 + 2 * i : 6 + 2 * i]
        if judged and n:
            out[f"{prefix}/accuracy/{name}"] = total / n
    if env_names:  # an environment's episodes (env/tool_call_rate: how often it calls a tool)
        base = 4 + 2 * len(groups)
        for i, k in enumerate(env_names):
            out[f"{prefix}/{k}"] = sums[base + i] / max(sums[base + len(env_names)], 1)
    return out


def _sampled_metrics(graded, examples, rewards, reduce, prefix, group_by, groups, k: int) -> dict[str, float]:
    """evaluate's sampled metrics: <prefix>/pass@1 and /pass@k, per group too (all prompts' rows
    and prompts summed over the shards first; <prefix>/reward stays greedy's)."""
    judged = correctness(rewards) is not None
    whole = {"all": _counts(graded) if graded is not None else GroupAccuracy(0, 0, 0, 0)}
    by_group = group_accuracy(graded, examples, group_by, groups) if graded is not None and group_by else {}
    sums = []
    for name in ["all", *groups]:
        g = whole["all"] if name == "all" else by_group.get(name, GroupAccuracy(0, 0, 0, 0))
        sums += [g.passed, g.counted, g.prompts_passed, g.prompts]
    sums = reduce(sums) if reduce else sums
    out = {}
    for i, name in enumerate(["all", *groups]):
        passed, counted, prompts_passed, prompts = sums[4 * i : 4 + 4 * i]
        suffix = "" if name == "all" else f"/{name}"
        if judged and counted:
            out[f"{prefix}/pass@1{suffix}"] = passed / counted
            out[f"{prefix}/pass@{k}{suffix}"] = prompts_passed / max(prompts, 1)
    return out


def _counts(graded: Scored) -> GroupAccuracy:
    """The accuracy rule over every row of `graded`, and over its prompts (GroupAccuracy's)."""
    flags = zip(graded.prompt_index.tolist(), graded.passed.tolist(), graded.applies.tolist())
    counted = [(prompt, passes) for prompt, passes, applies in flags if applies]
    return GroupAccuracy(
        passed=sum(passes for _, passes in counted),
        counted=len(counted),
        prompts_passed=len({prompt for prompt, passes in counted if passes}),
        prompts=len({prompt for prompt, _ in counted}),
    )


class GroupAccuracy(NamedTuple):
    """The accuracy rule (Scored.accuracy) over one group's rows, and over its prompts (pass@G: a
    prompt passes when one of its counted rows does)."""

    passed: int  # rows that pass
    counted: int  # rows the rule counts
    prompts_passed: int  # prompts with a counted row that passes
    prompts: int  # prompts with a counted row


def group_accuracy(
    graded: Scored, examples: list[Example], column: str | None, groups: Sequence[str]
) -> dict[str, GroupAccuracy]:
    """The accuracy rule per value of `column` (data.eval_group_by; a row's value is its prompt's,
    examples[prompt_index]) for each value in `groups` (group_values'; rows of other values are left
    out): what evaluate's <prefix>/accuracy/<value> and grpo-eval's <metric>/<value> report."""
    rows: dict[str, list[tuple[int, bool]]] = {name: [] for name in groups}  # value -> (prompt, passes)
    flags = zip(graded.prompt_index.tolist(), graded.passed.tolist(), graded.applies.tolist())
    for prompt, passes, applies in flags:
        group = str(examples[prompt].columns.get(column))
        if applies and group in rows:
            rows[group].append((prompt, passes))
    return {
        name: GroupAccuracy(
            passed=sum(passes for _, passes in counted),
            counted=len(counted),
            prompts_passed=len({prompt for prompt, passes in counted if passes}),
            prompts=len({prompt for prompt, _ in counted}),
        )
        for name, counted in rows.items()
    }


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
