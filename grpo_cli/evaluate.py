"""Held-out evaluation, the one evaluator of grpo-train and grpo-eval: `grade` samples G
completions of each prompt (greedy or with the sampler's settings) and scores them with the
configured rewards; `evaluate` (grpo-train's eval/ metrics) and grpo-eval report from its grades."""

from __future__ import annotations

from dataclasses import replace

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
) -> Scored | None:
    """Each example's `num_generations` completions (or episodes) drawn by `path` (its sampler's
    settings, or greedy: argmax), `prompts_per_call` prompts to one draw, scored by `rewards` into one record
    (scored.Scored: rows in example order, prompt_index into `examples`); None without examples."""
    parts, G = [], num_generations
    with path.sampler.sampling():  # (every process, even one with an empty shard: FSDP2 gathers)
        for start in range(0, len(examples), prompts_per_call):
            chunk = examples[start : start + prompts_per_call]
            drawn = path.draw_for_scoring(chunk, num_generations=G, greedy=greedy)
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
) -> dict[str, float]:
    """`eval/reward` (weighted total) and `eval/accuracy` (the accuracy rule, Scored.accuracy:
    the share of the rows the correctness reward applies to that pass; only when a correctness
    reward is configured: rewards.correctness) over the examples, one greedy completion each
    drawn by `path`, `batch_size` prompts at a time.
    With `group_by` (a column) also `eval/accuracy/<value>` for each value in `groups` (the
    same list on every process). `prefix` names the set (eval, eval_wide).
    reduce: sums a list of floats over the processes that evaluate a shard each
    (distributed.Dist.sum): the means are then over every shard."""
    graded = grade(path, tokenizer, examples, rewards, prompts_per_call=batch_size)
    judged = correctness(rewards) is not None
    totals = graded.totals.tolist() if graded is not None else []
    passed, counted = graded.accuracy() if graded is not None else (0, 0)
    by_group = {name: [0, 0] for name in groups}  # value -> [rows that pass, rows counted]
    if graded is not None and group_by:
        for i, (p, a) in enumerate(zip(graded.passed.tolist(), graded.applies.tolist())):
            group = str(examples[graded.prompt_index[i]].columns.get(group_by))
            if a and group in by_group:
                by_group[group][0] += p
                by_group[group][1] += 1
    env_names, env_sums = env_means(graded)
    sums = [sum(totals), len(totals), passed, counted]
    sums += [x for name in groups for x in by_group[name]]
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
