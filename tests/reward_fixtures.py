"""User-style reward functions for tests, loaded by import path (reward.<name>.fn=...)."""


def plus_parity(completions, prompts, **kwargs):
    """Signal only on "plus" prompts (odd/even length); every other group is zero-std."""
    return [float(len(c) % 2) if "plus" in p else 0.0 for c, p in zip(completions, prompts)]


def char_code(completions, **kwargs):
    """Varies with the text itself, so even equal-length completions differ."""
    return [float(sum(map(ord, c)) % 7) for c in completions]
