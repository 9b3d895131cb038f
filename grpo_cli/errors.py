"""User-facing errors: bad config, data, model or reward input, and the ways a run stops.

The console scripts print these as a short message and exit with a documented status, never a
traceback. Anything else is a bug and keeps its traceback.

Exit statuses of grpo-train: 0 done; 2 bad input (config, data, model, reward, checkpoint) or
an environment that cannot run it (device, precision, disk); 3 training diverged (too many
consecutive non-finite steps; a checkpoint of the last good state is written) or the step-0
self-check failed (sampler and trainer log-probs disagree; nothing was updated); 130/143
stopped by SIGINT/SIGTERM (a checkpoint is written once training has started).
"""

from __future__ import annotations

import sys

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


class UserError(Exception):
    """An error in what the user gave us (config, data, model path, reward code); exit 2."""


class TrainingDiverged(Exception):
    """Too many consecutive steps with a non-finite loss or gradient; exit 3. The message holds
    the diagnosis, the checkpoint of the last good state and how to resume."""


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) before training started, or a second one during a step: stop now.
    A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""

    def __init__(self, signal_name: str, exit_code: int):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = exit_code


class QuietExit(Exception):
    """A multi-process run stops on this rank, and another rank reports why (rank 0 for what
    every rank finds alike: bad config, bad data; the failing rank otherwise)."""

    def __init__(self, code: int):
        super().__init__(f"exit {code}")
        self.code = code


def first_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`: library errors can run to a page."""
    text = str(exc).strip().splitlines()
    line = text[0].strip() if text else ""
    if len(line) > limit:
        line = line[:limit].rstrip() + "..."
    return f"{type(exc).__name__}: {line.rstrip('.')}" if line else type(exc).__name__


def report_and_exit(title: str, problems: list[str], code: int = EXIT_USER_ERROR) -> None:
    """Print `title: problem`, or the title and one bullet per problem, then exit."""
    if len(problems) == 1:
        text = f"{title}: {problems[0]}"
    else:
        text = "\n".join([f"{title} ({len(problems)} problems):"] + [f"  - {p}" for p in problems])
    print(text, file=sys.stderr, flush=True)
    sys.exit(code)
