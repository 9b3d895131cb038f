"""The rewards' event loop: one asyncio loop per process, in a daemon thread, on which every async
reward of a step runs (an `async def` reward, a judge's HTTP calls), so that they overlap.

One loop that lives as long as the process (not an `asyncio.run` per step): an HTTP client's
connection pool belongs to the loop that opened it, so a judge's client is reused across steps. It
is a daemon thread, so a reward that never returns cannot keep the process alive after the run
has ended with its error (TRL runs async rewards the same way).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence
from typing import Any

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def loop() -> asyncio.AbstractEventLoop:
    """The process's reward loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="grpo-rewards-loop", daemon=True).start()
        return _loop


def gather(awaitables: Sequence[Awaitable], timeout: float | None = None) -> list[Any]:
    """Run `awaitables` concurrently on the reward loop and wait for them all; returns their
    results in order, each a value or the exception it raised (never raises for them). A
    TimeoutError for each one not done after `timeout` seconds (which is then cancelled)."""

    async def one(aw):
        try:
            return await asyncio.wait_for(aw, timeout) if timeout else await aw
        except asyncio.TimeoutError as exc:
            return TimeoutError(f"no result after {timeout:g} s") if timeout else exc
        except BaseException as exc:  # noqa: BLE001 - returned to the caller, which names the reward
            return exc

    async def every():
        return await asyncio.gather(*(one(aw) for aw in awaitables))

    return asyncio.run_coroutine_threadsafe(every(), loop()).result()


def run(awaitable: Awaitable) -> Any:
    """One awaitable on the reward loop; its result, or what it raised."""
    (result,) = gather([awaitable])
    if isinstance(result, BaseException):
        raise result
    return result
