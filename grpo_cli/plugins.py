"""The one plug-in shape: sampler backends, data sources, trackers, loss variants and environment
styles each declare themselves the same way, and rewards' `Reward` has the same fields (name,
options, check, build) with its facts spelled out.

A plug-in is a module that declares ``PLUGIN = Plugin(...)``. One rule finds them, built-in or
not: the built-ins are the modules of the kind's package whose names do not start with an
underscore, each named by its file (the YAML name), and a user's own is chosen by its import path
wherever the kind's name goes::

    sampler.backend=my_pkg.my_sampler           data.source=my_pkg.my_data
    loss.loss_type=my_pkg.my_loss               trainer.report_to=[jsonl,my_pkg.my_tracker]
    environment.style=my_pkg.my_style

The packages: grpo_cli/samplers/, grpo_cli/data/, grpo_cli/trackers/, grpo_cli/loss/variants/,
grpo_cli/environments/styles/. Rewards follow the same rule with their own declaration: a module
of grpo_cli/rewards/ that declares ``REWARD = Reward(...)`` is a built-in (the package's other
modules are its machinery), a user's is an import path in `reward.<name>.fn`.

So a new one is one module and one preset (conf/<group>/<name>.yaml, or a folder of the user's
on Hydra's search path), with no edit anywhere else (tests/test_plugins.py counts it), and the
names a message offers are the modules found. Its own options, typed by its `options` dataclass,
come from the section's `options` node (`sampler.options.beam=4`); the built-ins keep the flat
keys users already have. Its `check` runs in config validation, before any model loads.

What a plug-in may rely on is declared in `facts` (a frozen record of the kind's: a sampler
backend's is samplers.Facts, whose `exact_draw` decides whether the trainer corrects for the
sampler's numerics), never probed with hasattr.

There is no `close` here: what a plug-in builds and holds frees itself (a Sampler's and a
tracker's own `close()`, called by whoever built it); a loss variant, an environment style's
factory and a data source's rows hold nothing. (A reward's scoring function is a plain function,
so `Reward` keeps its `close`.)
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError


@dataclass(frozen=True)
class Plugin:
    """One plug-in, declared once.

    name: its name in YAML (a built-in's module name; a user's is its import path).
    build(...): makes what the kind asks for (a Sampler, a loss Variant, a tracker, a data
      source's rows, an environment factory); the kind's package documents the call.
    options: the dataclass of its own options and their defaults, read from `<section>.options`
      (None: it has none).
    check(cfg) -> problems: its checks of the config, one paragraph each, run by config
      validation before any model loads; the kind's package says what `cfg` is (the whole config
      for a sampler backend, the kind's section for the others, trainer.report_to for a tracker).
    facts: a frozen record of the kind's, what the rest of the code may rely on.
    """

    name: str
    build: Callable[..., Any]
    options: type | None = None
    check: Callable[[Any], list[str]] | None = None
    facts: Any = None

    def problems(self, cfg: Any) -> list[str]:
        return list(self.check(cfg)) if self.check is not None else []


def builtin_names(package: str) -> tuple[str, ...]:
    """The built-in plug-ins of `package` (an imported package's name): its public modules, sorted,
    found without importing them."""
    path = importlib.import_module(package).__path__
    return tuple(sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_")))


def is_import_path(name: str) -> bool:
    """Whether a plug-in name is a user's import path (`pkg.mod`, `mod:ATTR`; built-in names have
    neither a dot nor a colon)."""
    return "." in str(name) or ":" in str(name)


def import_user_module(module_name: str):
    """importlib.import_module for a module a user names by import path (a plug-in, a reward's or
    an environment's `fn`). Where it is not importable otherwise but sits in the working directory
    (`my_rewards.py`, or a package folder), the working directory is put first on the import path,
    once, as `python -m` does, and the import retried: `fn=my_rewards:f` works from the folder that
    holds my_rewards.py without PYTHONPATH=. (a console script's own folder is first instead)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".", 1)[0]
        cwd = os.getcwd()
        here = Path(cwd, f"{top}.py").is_file() or Path(cwd, top).is_dir()
        if exc.name != top or not here or cwd in sys.path or "" in sys.path:
            raise
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def load(package: str, name: str, where: str) -> Plugin:
    """The plug-in called `name`: the built-in module `package.name`, or the module at the import
    path `name` (`pkg.mod`, or `pkg.mod:ATTR` for a declaration not called PLUGIN). where: the key
    that named it (`sampler.backend`), for the error."""
    if not is_import_path(name):
        builtins = builtin_names(package)
        if name not in builtins:
            raise UserError(
                f"{where}={name!r} is not one of {', '.join(builtins)}; choose one of those, or give the "
                f"import path of a module of yours that declares PLUGIN (e.g. {where}=my_pkg.my_module)."
            )
        module_name, attr = f"{package}.{name}", "PLUGIN"
    else:
        module_name, _, attr = str(name).partition(":")
        attr = attr or "PLUGIN"
    try:
        module = import_user_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"{where}={name!r}: module {module_name!r} cannot be imported ({exc}). Install it, or run from "
            "the folder that holds it (it must be on the import path)."
        ) from exc
    declared = getattr(module, attr, None)
    if not isinstance(declared, Plugin):
        raise UserError(
            f"{where}={name!r}: {module_name}.{attr} is {type(declared).__name__}, not a "
            f"grpo_cli.plugins.Plugin; declare `{attr} = Plugin(name=..., build=...)` in {module_name}."
        )
    return declared


def check_name(package: str, name: str, where: str) -> list[str]:
    """`where`'s problem (a list of at most one) when `name` names no plug-in of `package`."""
    try:
        load(package, name, where)
    except UserError as exc:
        return [str(exc)]
    return []


def read_options(plugin: Plugin, node: Mapping[str, Any] | None, where: str) -> Any:
    """The plug-in's options from its `options` node (a mapping; None or {}: the defaults), as an
    instance of plugin.options. UserError naming every unknown key, or options given to a plug-in
    that takes none."""
    node = dict(node or {})
    if plugin.options is None:
        if node:
            raise UserError(f"{where}={node} is set, but {plugin.name} takes no options; drop {where}.")
        return None
    known = {f.name for f in dataclasses.fields(plugin.options)}
    unknown = sorted(set(node) - known)
    if unknown:
        raise UserError(
            f"{where} has {', '.join(unknown)}, which {plugin.name} does not read; its options are "
            f"{', '.join(sorted(known)) or 'none'}."
        )
    try:
        return plugin.options(**node)
    except TypeError as exc:
        raise UserError(f"{where}={node}: {exc}") from exc


def foreign_keys(package: str, chosen: str, facts_of: Callable[[str], Any]) -> dict[str, str]:
    """The keys that the other built-ins of `package` read and `chosen` does not (each one's
    `facts_of(name).keys`), each with the built-in that reads it: a setting the chosen one ignores."""
    mine = set(facts_of(chosen).keys)
    return {
        key: name
        for name in builtin_names(package)
        if name != chosen
        for key in facts_of(name).keys
        if key not in mine
    }
