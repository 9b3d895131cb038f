"""Writing files whole: a reader (or a crash) never sees half of one; and durably (fsync)."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_cli.errors import UserError, first_line


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place (one atomic
    step); the temporary file is removed if anything fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_tree(folder: Path) -> None:
    """Flush every file of `folder` and its entries to the disk (a checkpoint, before its rename)."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    """Make renames inside `folder` durable (power loss); a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_error(path, exc: OSError) -> UserError:
    """The error for a file or folder that could not be written (a full or read-only disk)."""
    return UserError(
        f"could not write {path}: {first_line(exc)}. Free disk space or point hydra.run.dir at a "
        "writable disk with room."
    )
