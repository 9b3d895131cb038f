"""A call of user code with a time limit (an environment's tools and steps, a reward)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def call_with_timeout(
    fn: Callable, args: tuple, timeout_s: float | None, what: str, setting: str, kwargs=None
):
    """fn(*args, **kwargs) in a daemon thread, at most timeout_s seconds (0 or None: no limit, called
    directly). A call that takes longer raises TimeoutError naming `what` and the `setting` that
    sets the limit; its thread is left to finish on its own (Python cannot stop a thread), so a
    call that never returns holds one idle thread, never the run."""
    kwargs = kwargs or {}
    if not timeout_s:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"grpo {what}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} took longer than {setting}={timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
