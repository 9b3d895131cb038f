"""Reward functions written exactly as TRL's GRPOTrainer documentation shows them, for a
conversational dataset (completions arrive as [{"role": "assistant", "content": ...}]), loaded
by import path in the tests: grpo-cli must run them unchanged. Sources: TRL's GRPOTrainer guide,
"Using a custom reward function", examples 1-3, and trl.rewards.think_format_reward's contract."""

import re


def reward_len(completions, **kwargs):
    # Example 1 (standard format, so written for strings): not for chat data.
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_contains_answer(completions, answer, **kwargs):
    # In the style of example 3 (a reward from a reference column), for the conversational format.
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if str(a) in c else 0.0 for c, a in zip(contents, answer)]


# TRL's keyword call (TRL 1.16 GRPOTrainer._calculate_rewards: prompts=, completions=,
# completion_ids=, the dataset's columns, trainer_state, log_metric, log_extra, all by keyword).
# Signatures as TRL's documentation writes them ("Using a custom reward function").


def prompt_first(prompts, completions, **kwargs):
    # The first parameter is prompts: a positional call would give it the completions.
    return [float(len(c) > len(p)) for p, c in zip(prompts, completions)]


def from_solution(completions, solution, **kwargs):
    return [1.0 if s in c else 0.0 for c, s in zip(completions, solution)]


def by_progress(completions, trainer_state, **kwargs):
    # Reward shaping by training progress, as TRL's trainer_state allows.
    return [float(trainer_state.global_step) / max(trainer_state.max_steps, 1)] * len(completions)


def logs_a_metric(completions, log_metric, **kwargs):
    lengths = [len(c) for c in completions]
    log_metric("mean_chars", sum(lengths) / len(lengths))
    return [1.0] * len(completions)


def not_applicable_without_solution(prompts, completions, solution, **kwargs):
    # TRL's None: this reward does not apply to the row.
    return [None if s == "" else float(s in c) for c, s in zip(completions, solution)]


def needs_log_extra(completions, log_extra, **kwargs):
    log_extra("chars", [len(c) for c in completions])
    return [0.0] * len(completions)


def bad_log_extra(completions, log_extra, **kwargs):
    log_extra("chars", [0])  # one value, whatever the number of completions
    return [0.0] * len(completions)
