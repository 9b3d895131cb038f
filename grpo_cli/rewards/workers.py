"""reward.<name>.workers: a synchronous reward run in a pool of worker processes, one call per
completion, each at most reward.<name>.call_timeout_s seconds.

For CPU-heavy rewards (math verification): the training process's Python runs one thread at a time,
worker processes run side by side. The pool starts on the reward's first call ("spawn": a fresh
interpreter, no copy of the training process's threads or model) and lives until the run closes
its rewards. A call that does not return in time ends the run with one paragraph naming the
reward and the completion; the pool's processes are then killed, so a hung reward never holds the
run or the machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Callable
from typing import Any

from grpo_cli.calls import call_with_timeout
from grpo_cli.rewards._calling import invoke


def _one(fn: Callable, completion: Any, kwargs: dict, timeout_s: float | None, what: str):
    """In a worker: fn on one completion (TRL's signature, lists of one), at most timeout_s."""
    try:
        (value,) = call_with_timeout(invoke, (fn, [completion], kwargs), timeout_s, what, "call_timeout_s")
    except TimeoutError as exc:
        return ("timeout", str(exc))
    return ("value", value)


class Pool:
    """`workers` processes that score completions one call each."""

    def __init__(self, name: str, fn: Callable, workers: int, timeout_s: float | None):
        self.name, self.fn, self.workers, self.timeout_s = name, fn, workers, timeout_s
        self._executor: cf.ProcessPoolExecutor | None = None

    def __call__(self, completions: list, rows: list[dict]) -> list:
        """The values for `completions`; rows[i]: completion i's keyword arguments (its own row of
        every column). Raises TimeoutError (which completion, how long) or what fn raised."""
        if self._executor is None:
            self._executor = cf.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn")
            )
        what = f"reward {self.name!r}"
        futures = [
            self._executor.submit(_one, self.fn, c, kw, self.timeout_s, what)
            for c, kw in zip(completions, rows)
        ]
        values = []
        try:
            for i, future in enumerate(futures):
                kind, value = future.result()
                if kind == "timeout":
                    raise TimeoutError(f"completion index {i}: {value}")
                values.append(value)
        except BaseException:
            self.close()  # (a hung call's worker would never free its process)
            raise
        return values

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((executor._processes or {}).values())  # (no public handle on them)
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.kill()
