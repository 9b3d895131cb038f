"""Held-out evaluation: greedy (default) or sampled completions, scored by the configured rewards."""

from __future__ import annotations

import torch

from grpo_cli.data import Example
from grpo_cli.rewards import as_reward_input, correctness, score_rewards

# transformers 4.x's clean-up of tokenization spaces (PreTrainedTokenizerBase.clean_up_tokenization).
_SPACE_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_spaces(text: str) -> str:
    for before, after in _SPACE_CLEANUP:
        text = text.replace(before, after)
    return text


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """The completions' text, as the rewards see it. Decoding is explicit so that the text (and so
    the rewards) does not depend on the transformers version: 4.x applies the tokenizer's
    `clean_up_tokenization_spaces` setting, 5.x ignores it for BPE tokenizers (SmolLM2's "15 ."
    instead of "15."). So: decode without the clean-up, then apply 4.x's when the tokenizer asks."""
    texts = tokenizer.batch_decode(
        [ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask)],
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [clean_up_spaces(t) for t in texts]
    return texts


def score_examples(rewards, tokenizer, examples: list[Example], rollout, num_generations: int):
    """Rewards of a rollout whose rows are `num_generations` completions per example, in order;
    returns (the completions' texts, weighted totals, values per reward)."""
    texts = decode_completions(tokenizer, rollout.completion_ids, rollout.completion_mask)
    columns: dict[str, list] = {}
    for ex in examples:
        for key, value in ex.columns.items():
            columns.setdefault(key, []).extend([value] * num_generations)
    prompts = [ex.prompt for ex in examples for _ in range(num_generations)]
    completion_ids = [
        ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)
    ]
    completions = [as_reward_input(prompt, text) for prompt, text in zip(prompts, texts)]
    total, per_reward = score_rewards(
        rewards, completions, prompts=prompts, completion_ids=completion_ids, columns=columns
    )
    return texts, total, per_reward


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
    judge = correctness(rewards)
    totals, accuracy = [], []
    by_group = {g: [0.0, 0] for g in groups}  # value -> [accuracy sum, count]
    with sampler.sampling():  # (every process, even one with an empty shard: FSDP2 gathers)
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            rollout = sampler.generate([ex.prompt_ids for ex in chunk], num_generations=1, greedy=True)
            _, total, per_reward = score_examples(rewards, tokenizer, chunk, rollout, 1)
            totals += total
            if judge is not None:
                accuracy += [v for v in per_reward[judge.name] if v is not None]
                for ex, v in zip(chunk, per_reward[judge.name]):
                    group = str(ex.columns.get(group_by)) if group_by else None
                    if v is not None and group in by_group:
                        by_group[group][0] += v
                        by_group[group][1] += 1
    sums = [sum(totals), len(totals), sum(accuracy), len(accuracy)]
    sums += [x for g in groups for x in by_group[g]]
    sums = reduce(sums) if reduce else sums
    reward_sum, reward_n, accuracy_sum, accuracy_n = sums[:4]
    out = {f"{prefix}/reward": reward_sum / max(reward_n, 1)}
    if accuracy_n:
        out[f"{prefix}/accuracy"] = accuracy_sum / accuracy_n
    for i, g in enumerate(groups):
        total, n = sums[4 + 2 * i : 6 + 2 * i]
        if n:
            out[f"{prefix}/accuracy/{g}"] = total / n
    return out


def group_values(examples: list[Example], column: str | None) -> list[str]:
    """The sorted values of a column over the examples (for evaluate's group_by), [] when absent."""
    if not column:
        return []
    values = sorted({str(ex.columns[column]) for ex in examples if column in ex.columns})
    return values if len(values) <= MAX_GROUPS else []  # a per-row id is no breakdown


MAX_GROUPS = 20
