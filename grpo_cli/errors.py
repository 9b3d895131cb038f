"""User-facing errors: bad config, data, model or reward input.

The console scripts print these as a short message and exit with status 2, never a traceback.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error in what the user gave us (config, data, model path, reward code); exit 2."""


def report_and_exit(title: str, problems: list[str], code: int = EXIT_USER_ERROR) -> None:
    """Print `title: problem`, or the title and one bullet per problem, then exit."""
    if len(problems) == 1:
        text = f"{title}: {problems[0]}"
    else:
        text = "\n".join([f"{title} ({len(problems)} problems):"] + [f"  - {p}" for p in problems])
    print(text, file=sys.stderr, flush=True)
    sys.exit(code)
