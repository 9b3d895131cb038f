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
