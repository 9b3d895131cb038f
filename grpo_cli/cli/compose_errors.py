"""grpo-train's composition errors, reworded: Hydra's own messages (a bad type, an unknown key or
option, an override it cannot parse) captured from stderr while it composes, and turned into one
paragraph that names the bad value and the fix (the nearest key, the group's options)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys

from grpo_cli.config import Config


class _StderrCapture:
    """Holds what Hydra writes to stderr until our task starts, so that a composition error
    can be reworded (and its traceback, if any, dropped); afterwards it passes writes through."""

    def __init__(self, real):
        self.real = real
        self.parts: list[str] = []
        self.capturing = False

    def start(self) -> None:
        if sys.stderr is not self:
            self.real = sys.stderr
        self.capturing = True
        sys.stderr = self

    def release(self) -> str:
        """Stop capturing; return what was captured (the caller prints or rewords it)."""
        text = "".join(self.parts)
        self.parts, self.capturing = [], False
        if sys.stderr is self:
            sys.stderr = self.real
        return text

    def write(self, text: str) -> int:
        if self.capturing:
            self.parts.append(text)
            return len(text)
        return self.real.write(text)

    def flush(self) -> None:
        self.real.flush()

    def __getattr__(self, name):
        return getattr(self.real, name)


STDERR = _StderrCapture(sys.stderr)


def _group_fields(group: str) -> list[str]:
    for f in dataclasses.fields(Config):
        if f.name == group:
            node = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(node):
                return [g.name for g in dataclasses.fields(node)]
    return []


def _group_options(group: str) -> list[str]:
    from importlib.resources import files

    try:
        folder = files("grpo_cli.conf") / group
        return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    except (FileNotFoundError, NotADirectoryError, OSError):
        return []


def explain_compose_error(text: str) -> str:
    """Hydra's message without its noise (search path, class names, traceback), plus the fix."""
    lines = text.strip().splitlines()
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        last = [
            line.strip()
            for line in lines
            if line.strip() and not line.startswith("Set the environment variable")
        ]
        return (
            f"grpo-train: could not start the run: {last[-1] if last else 'unknown error'}.\n"
            "Check hydra.run.dir (a folder grpo-train can create and write to) and the other overrides."
        )
    keep, in_search_path = [], False
    for line in lines:
        if line.startswith("Config search path:"):
            in_search_path = True
            continue
        if in_search_path and line.startswith("\t"):
            continue
        in_search_path = False
        stripped = line.strip()
        if (
            not stripped
            or stripped.startswith(("reference_type=", "object_type=", "To append to your config"))
            or line.startswith("Set the environment variable HYDRA_FULL_ERROR")
        ):
            continue
        keep.append(line.rstrip())
    hints = []
    key = re.search(r"Key '([^']+)' not in '[^']+'", text)
    full = re.search(r"full_key: ([\w.]+)", text)
    if key and full and "." in full.group(1):
        group = full.group(1).split(".")[0]
        fields = _group_fields(group)
        close = difflib.get_close_matches(key.group(1), fields, n=1)
        hints.append(
            f"{full.group(1)} is not a key of {group}"
            + (f"; did you mean {group}.{close[0]}?" if close else ".")
            + (f" Its keys: {', '.join(fields)}." if fields else "")
        )
    typed = re.search(r"could not be converted to (\w+)", text)
    if typed and full:
        hints.append(f"give {full.group(1)} a value of type {typed.group(1).lower()}.")
    missing = re.search(r"Could not (?:load|find) '([\w-]+)/([^']+)'", text)
    if missing and "Available options" not in text:
        options = _group_options(missing.group(1))
        if options:
            hints.append(
                f"{missing.group(1)} has no option {missing.group(2)!r}; the options are: "
                f"{', '.join(options)} (add your own with --config-dir)."
            )
    if "override_grammar" in text:
        for arg in _unparsable_overrides(sys.argv[1:]):
            hints.append(
                f"cannot parse the override {arg!r}; quote values with special characters, e.g. "
                "'reward=[accuracy,format]' or 'data.system_prompt=\"Be brief.\"'."
            )
    hints.append(
        "`grpo-train --cfg job` prints the composed config with every key; `grpo-train --help` "
        "lists each group's options."
    )
    return "\n".join(["grpo-train: invalid command line:"] + [f"  {line.strip()}" for line in keep] + hints)


def _unparsable_overrides(args: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    bad = []
    for arg in args:
        if arg.startswith("-"):
            continue
        try:
            parser.parse_override(arg)
        except Exception:  # noqa: BLE001 - any parse failure names the culprit
            bad.append(arg)
    return bad
