"""Keys that were renamed: the old name is still read, as the new one, with a one-line note.

One naming rule for time limits (issue #47): every one ends in `_timeout_s` (seconds), as
`reward.<name>.call_timeout_s`, `reward.judge.timeout_s` and `environment.timeout_s` do. The
schema keeps each old key as an Optional field (None: not given), so Hydra still composes it.
"""

from __future__ import annotations

from typing import Any

#: old dotted key -> new dotted key (same section)
RENAMED = {
    "sampler.stall_timeout": "sampler.stall_timeout_s",
    "trainer.distributed_timeout": "trainer.distributed_timeout_s",
}


def apply_renames(cfg: Any) -> list[str]:
    """Each old key given (not None) in the composed config is moved to its new name; returns one
    note per key moved, naming both."""
    notes = []
    for old, new in RENAMED.items():
        section, old_key = old.split(".")
        new_key = new.split(".")[1]
        node = cfg[section]
        value = node[old_key]
        if value is None:
            continue
        node[new_key] = value
        node[old_key] = None
        notes.append(f"{old} is now {new} (read as {new}={value}); the old name will go, rename it.")
    return notes
