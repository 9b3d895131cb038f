"""User-style reward functions for tests, loaded by import path (reward.<name>.fn=...)."""


def plus_parity(completions, prompts, **kwargs):
    """Signal only on "plus" prompts (odd/even length); every other group is zero-std."""
    return [float(len(c) % 2) if "plus" in p else 0.0 for c, p in zip(completions, prompts)]


def char_code(completions, **kwargs):
    """Varies with the text itself, so even equal-length completions differ."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


SIGNAL_CALLS = {"n": 0}


def signal_once(completions, **kwargs):
    """Rewards that vary on the first call only; every later group is zero-std (no signal).
    Tests reset SIGNAL_CALLS["n"] before a run."""
    SIGNAL_CALLS["n"] += 1
    if SIGNAL_CALLS["n"] == 1:
        return [float(i % 2) for i in range(len(completions))]
    return [0.5] * len(completions)


def alternating(completions, **kwargs):
    """0, 1, 0, 1, ... whatever the text: every group of an even size has signal."""
    return [float(i % 2) for i in range(len(completions))]


def fails_on_rank_1(completions, **kwargs):
    """A reward that raises on the second process of a multi-process run only."""
    import os

    if os.environ.get("RANK") == "1":
        raise ValueError("rank 1's reward cannot score this")
    return [float(len(c) % 3) for c in completions]


def hangs_on_rank_1(completions, **kwargs):
    """A reward that never returns on the second process of a multi-process run."""
    import os
    import time

    if os.environ.get("RANK") == "1":
        while True:
            time.sleep(1)
    return [float(len(c) % 3) for c in completions]


def constant(completions, **kwargs):
    """The same reward for every completion: every group is zero-std."""
    return [1.0] * len(completions)


def near_a(completions, **kwargs):
    """How close a completion's characters are to "a" (0 for "aaaa", lower the farther each
    character's code is): every completion scores differently, and one completion is best, so a
    policy pushed hard toward it ends deterministic, its entropy near 0, whatever the trajectory."""
    return [-sum(abs(ord(ch) - ord("a")) for ch in c) / (100 * max(len(c), 1)) for c in completions]


def rare_pass(completions, **kwargs):
    """1 for about one completion in ten (by its characters), else 0: most groups of 4 all fail, so
    adaptive group sizes sample more rounds."""
    return [float(sum(map(ord, c)) % 10 == 0) for c in completions]


def no_signal_on_minus(completions, prompts, **kwargs):
    """char_code's values, but 0 for every completion of a "minus" prompt: those groups are
    zero-std, the others carry signal."""
    return [0.0 if "minus" in p else float(sum(map(ord, c)) % 7) for c, p in zip(completions, prompts)]


def _lifecycle_log(event: str) -> None:
    """Appends one line to the file that $GRPO_TEST_LIFECYCLE names (the test reads it)."""
    import os

    with open(os.environ["GRPO_TEST_LIFECYCLE"], "a") as f:
        f.write(event + "\n")


def _load_scorer(device, dist, *, bonus: float = 1.0, fail_after: int = 0, **_):
    """A reward with a lifecycle, as a reward model has: built once per process on the device,
    closed at the end. fail_after > 0: its scorer raises on that call (a run that ends in error)."""
    _lifecycle_log(f"build device={device} dist={type(dist).__name__} bonus={bonus}")
    calls = {"n": 0}

    def score(completions, **kwargs):
        calls["n"] += 1
        if fail_after and calls["n"] >= fail_after:
            raise RuntimeError("scorer failed on purpose")
        return [bonus * (len(c) % 2) for c in completions]

    return score


def _close_scorer(scorer) -> None:
    _lifecycle_log("close")


def _build_reward():
    from grpo_cli.rewards import Reward

    return Reward(name="lifecycle", build=_load_scorer, close=_close_scorer)


LIFECYCLE = _build_reward()


def environment_reward(completions, env_reward=None, **kwargs):
    """The environment's own reward of each episode (None where it gave none)."""
    return list(env_reward) if env_reward is not None else [None] * len(completions)
