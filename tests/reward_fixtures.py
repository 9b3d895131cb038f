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


async def async_chars(completions, **kwargs):
    """An async reward: waits as a network call would (reward_fixtures.ASYNC_DELAY seconds), then
    scores the text's length modulo 3."""
    import asyncio

    await asyncio.sleep(ASYNC_DELAY)
    return [float(len(c if isinstance(c, str) else c[-1]["content"]) % 3) for c in completions]


ASYNC_DELAY = 0.3


def hangs(completions, **kwargs):
    """A reward that never returns (a verifier stuck on its input)."""
    import time

    time.sleep(3600)


async def hangs_async(completions, **kwargs):
    import asyncio

    await asyncio.sleep(3600)


def digit_sum(completions, **kwargs):
    """CPU work per completion, the same value in any process: the sum of the text's digits."""
    return [
        float(sum(int(ch) for ch in (c if isinstance(c, str) else c[-1]["content"]) if ch.isdigit()))
        for c in completions
    ]


def stuck_on_seven(completions, **kwargs):
    """Returns at once, except on a completion holding a 7, where it never returns."""
    import time

    for c in completions:
        if "7" in (c if isinstance(c, str) else c[-1]["content"]):
            time.sleep(3600)
    return [1.0] * len(completions)


_MET = {}


async def _meet(me: str, other: str, completions):
    """Marks `me` as started, then waits (up to 10 s) for `other` to have started."""
    import asyncio

    _MET[me] = asyncio.get_running_loop().time()
    for _ in range(1000):
        if other in _MET:
            return [1.0] * len(completions)
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{other} never started while {me} waited: the async rewards ran one after the other")


async def meets_a(completions, **kwargs):
    return await _meet("b", "a", completions)


async def meets_b(completions, **kwargs):
    return await _meet("a", "b", completions)


def nan_on_seven(completions, **kwargs):
    """NaN for a completion holding a 7 (a reward that cannot score it), else 1."""
    return [float("nan") if "7" in c else 1.0 for c in completions]


def _may_fail():
    from grpo_cli.rewards import Reward

    return Reward("may_fail", fn=nan_on_seven, nan_ok=True)


MAY_FAIL = _may_fail()
