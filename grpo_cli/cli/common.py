"""What the commands share: composing the shipped config (plus a user's config folder or a
checkpoint's saved config), validating it, and reporting failures as one short paragraph."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_cli.config import Config, task, to_typed, validate
from grpo_cli.config.renamed import apply_renames
from grpo_cli.errors import UserError

#: a key a config does not have (what `~key` leaves, and what `+key` adds to)
_ABSENT = object()
#: the differences a refusal names for one override (the rest are counted)
_SHOWN = 12


def compose_config(
    overrides: list[str], *, checkpoint: str | None = None, config_dir: str | None = None, check: bool = True
):
    """The shipped config with `overrides` (a DictConfig), as grpo-train composes it.

    config_dir: a folder of the user's own config groups, added to the shipped ones (as
    grpo-train --config-dir does). checkpoint: a grpo-cli checkpoint folder; its saved config (its
    data, sampler and reward settings) with the overrides on top (_checkpoint_config says which
    apply), and the checkpoint as the model (a LoRA checkpoint: its adapter on config.yaml's base
    model). check: validate the whole config (every problem in one UserError).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        if checkpoint:
            cfg = _checkpoint_config(checkpoint, overrides)
        else:
            if config_dir:
                overrides = overrides + [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
            cfg = _compose_shipped(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        message = str(exc).strip().splitlines()[0]
        if "reward/" in message:
            from grpo_cli.rewards import REGISTRY

            message += (
                f" Built-in rewards: {', '.join(REGISTRY)}; add your own with "
                "+reward.NAME.fn=package.module:function."
            )
        raise UserError(message) from exc
    for note in apply_renames(cfg):  # an old key's name (a saved config's too): read as the new one
        print(f"note: {note}", file=sys.stderr, flush=True)
    if not checkpoint:  # (a saved config names its rewards)
        for note in task.apply(cfg, overrides):  # the task's rewards where the user chose none
            print(f"note: {note}", file=sys.stderr, flush=True)
    if check:
        problems = validate(cfg, unused_ok=bool(checkpoint))
        if problems:
            raise UserError("invalid configuration: " + " ".join(problems))
    return cfg


def _compose_shipped(overrides: list[str]):
    """Hydra's compose of the shipped config (grpo_cli.conf, `config`) with `overrides`."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _checkpoint_config(checkpoint: str, overrides: list[str]):
    """A checkpoint's saved config (its config.yaml over the schema) with `overrides`, the
    checkpoint as its model.

    group=option replaces that section with the preset and key=value sets a key, as on grpo-train's
    command line. A list, +key, ~key or experiment= is accepted where it changes nothing of that
    config (a run's own command line, repeated) and refused, naming each difference, where it does
    (_check_unchanged).
    """
    from omegaconf import OmegaConf

    saved = Path(checkpoint) / "config.yaml"
    if not saved.is_file():
        raise UserError(
            f"--checkpoint {checkpoint!r} has no config.yaml; give a grpo-cli "
            "checkpoint folder (outputs/.../checkpoints/step-N), or evaluate a plain "
            "model folder with model.name_or_path=DIR."
        )
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(saved))
    split = _checkpoint_overrides(overrides)
    if split.presets:  # group=option: that section becomes the preset, as grpo-train composes it
        shipped = _compose_shipped(split.presets)
        for override in split.presets:
            group = override.split("=", 1)[0]
            cfg[group] = shipped[group]
    cfg.merge_with_dotlist(split.keys)  # key=value overrides after the presets
    if split.compared or split.removed:
        _check_unchanged(cfg, overrides, split)
    # Evaluating or exporting logs to no tracker (the run's W&B may not be installed or
    # logged in here), and a setting its run ignored (a sweep's adapter.r with adapter=none)
    # stays ignored: neither is a problem for this checkpoint.
    cfg.trainer.report_to = ["jsonl"]
    if cfg.adapter.name != "none":  # base model (config.yaml's) + the checkpoint's adapter
        cfg.adapter.path = str(Path(checkpoint).resolve())
    else:  # the checkpoint is the full model
        cfg.model.name_or_path = str(Path(checkpoint).resolve())
        cfg.model.gguf_file = None
    return cfg


@dataclass
class _Split:
    """A checkpoint's overrides by how they apply: presets (group=option) and keys (key=value)
    are applied; compared (a list, +key, experiment=: override -> the dotted paths it sets) and
    removed (~key: override -> its path) must leave the saved config as it is; void ones
    (experiment=null) set nothing."""

    presets: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    compared: dict[str, list[str]] = field(default_factory=dict)
    removed: dict[str, str] = field(default_factory=dict)
    void: list[str] = field(default_factory=list)


def _checkpoint_overrides(overrides: list[str]) -> _Split:
    """A saved config's overrides, split by how they apply (_Split); a UserError, naming them,
    for one that is not an override at all (no `=`)."""
    from dataclasses import fields

    groups = [f.name for f in fields(Config)]
    split, bad = _Split(), []
    for override in overrides:
        key, _, value = override.partition("=")
        if override.startswith("~"):
            split.removed[override] = key[1:]
        elif "=" not in override:
            bad.append(override)
        elif override.startswith("+"):
            split.compared[override] = [key.lstrip("+")]
        elif key == "experiment" and value in ("", "null"):
            split.void.append(override)  # no experiment: the shipped defaults' choice
        elif key == "experiment":
            split.compared[override] = _experiment_paths(value)
        elif _is_list(override):
            split.compared[override] = [key]
        elif key in groups:
            split.presets.append(override)
        else:
            split.keys.append(override)
    if bad:
        raise UserError(
            f"with --checkpoint these are not overrides: {', '.join(bad)}. A checkpoint's saved "
            "config takes key=value, and group=option for one preset of a group "
            f"({', '.join(groups)}), as grpo-train's command line does."
        )
    return split


def _is_list(override: str) -> bool:
    """Whether Hydra reads the override's value as a list (`reward=[accuracy,format]`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException:  # not Hydra's grammar: a plain key=value, as OmegaConf reads it
        return False
    return not parsed.is_sweep_override() and isinstance(parsed.value(), list)


def _experiment_paths(name: str) -> list[str]:
    """The dotted paths a shipped experiment sets: each group it chooses (the whole section) and
    each key of its own, outside those sections ([] for one not shipped: composing names it)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    source = files("grpo_cli.conf") / "experiment" / f"{name}.yaml"
    if not source.is_file():
        return []
    body = OmegaConf.to_container(OmegaConf.create(source.read_text())) or {}
    sections = []
    for entry in body.pop("defaults", None) or []:
        if isinstance(entry, dict):
            for key in entry:  # "override /reward", "/model@teacher"
                group = key.removeprefix("override").strip().lstrip("/")
                sections.append(group.split("@", 1)[-1])
    keys = [p for p in _leaf_paths(body) if not any(p == s or p.startswith(s + ".") for s in sections)]
    return sections + keys


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    """The dotted paths of a plain container's leaves under `prefix` (a list is a leaf)."""
    if not isinstance(node, dict) or not node:
        return [prefix] if prefix else []
    return [p for key, value in node.items() for p in _leaf_paths(value, f"{prefix}.{key}".lstrip("."))]


def _check_unchanged(cfg, overrides: list[str], split: _Split) -> None:
    """Nothing, where each list, +key and experiment= of `overrides` leaves `cfg` (a checkpoint's
    saved config with its presets and key=value overrides) as it is on the paths it sets, compared
    with grpo-train's compose of `overrides`, and each ~key names a key `cfg` does not have. A
    UserError otherwise, naming each difference as `path: saved -> given`. The paths the
    checkpoint sets itself (_rewritten) are not compared."""
    saved = _plain(cfg)
    given = {}
    if split.compared:  # ~key: removed here (Hydra refuses to remove a key the config lacks)
        composed = [o for o in overrides if o not in split.removed and o not in split.void]
        given = _plain(_compose_shipped(composed))
        for path in split.removed.values():
            parent, _, last = path.rpartition(".")
            node = _at(given, parent) if parent else given
            if isinstance(node, dict):
                node.pop(last, None)
    ignored = _rewritten(cfg)
    checks = {o: [(path, _at(given, path)) for path in paths] for o, paths in split.compared.items()}
    checks.update({o: [(path, _ABSENT)] for o, path in split.removed.items()})
    found: dict[str, list[str]] = {}  # override -> the differences it makes
    for at, line in dict.fromkeys(
        difference
        for pairs in checks.values()
        for path, value in pairs
        for difference in _differences(path, _at(saved, path), value, ignored)
    ):
        found.setdefault(_owner(at, checks, overrides), []).append(line)
    if found:
        named = [
            f"{o} ({'; '.join(found[o][:_SHOWN])}{_more(len(found[o]) - _SHOWN)})"
            for o in checks
            if o in found
        ]
        raise UserError(
            "with --checkpoint these overrides change what the checkpoint was trained with (saved -> "
            f"given, as grpo-train composes them): {', '.join(named)}. A list, +key, ~key or "
            "experiment= is taken only where it changes nothing of the saved config (the run's own "
            "command line, repeated); set the keys you need one by one with key=value (or "
            "group=option for a preset), or train a new run with these overrides."
        )


def _more(count: int) -> str:
    """How many differences a refusal leaves out ("" for none)."""
    return f"; and {count} more" if count > 0 else ""


def _owner(at: str, checks: dict[str, list], overrides: list[str]) -> str:
    """The override a difference at dotted path `at` is named under, of those whose paths hold it
    or lie within it: the one that sets it most narrowly (+reward.length.weight=1, not the reward
    list that holds it); on a tie the one Hydra applies last (+key and ~key after experiment=,
    experiment= after a list), then the later on the command line."""

    def related(path: str) -> bool:
        return at == path or at.startswith(path + ".") or path.startswith(at + ".")

    def rank(candidate: tuple[str, str]) -> tuple[int, int, int]:
        override, path = candidate
        kind = 2 if override[0] in "+~" else 1 if override.startswith("experiment=") else 0
        return path.count("."), kind, overrides.index(override)

    candidates = [(o, path) for o, pairs in checks.items() for path, _ in pairs if related(path)]
    return max(candidates, key=rank)[0]


def _plain(cfg) -> dict:
    """`cfg` as a plain container, as grpo-train saves it: renamed keys under their new names and
    loss.sampler_correction=auto resolved for the chosen sampler (train.train_config does both)."""
    import copy

    from omegaconf import OmegaConf

    from grpo_cli.samplers import sampler_correction

    cfg = copy.deepcopy(cfg)
    apply_renames(cfg)
    try:
        cfg.loss.sampler_correction = sampler_correction(cfg.loss, cfg.sampler)
    except UserError:  # a backend that does not load: validation names it
        pass
    return OmegaConf.to_container(cfg, resolve=True)


def _rewritten(cfg) -> set[str]:
    """The paths _checkpoint_config sets whatever was saved or given: the tracker, and the
    checkpoint as the adapter (LoRA) or as the model."""
    if cfg.adapter.name != "none":
        return {"trainer.report_to", "adapter.path"}
    return {"trainer.report_to", "model.name_or_path", "model.gguf_file"}


def _at(node: Any, path: str) -> Any:
    """The value at a dotted path of a plain container; _ABSENT where there is none."""
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _ABSENT
        node = node[key]
    return node


def _differences(path: str, saved: Any, given: Any, ignored: set[str]) -> list[tuple[str, str]]:
    """(dotted path, `path: saved -> given`) for each difference between two plain values at
    `path`, skipping the paths in `ignored`: a section whose keys differ is named by its keys
    (`reward: [accuracy, format] -> [accuracy]`), then the keys both have are compared one by one."""
    if path in ignored:
        return []
    if isinstance(saved, dict) and isinstance(given, dict):
        lines = []
        if set(saved) != set(given):
            lines.append((path, f"{path}: {_render(list(saved))} -> {_render(list(given))}"))
        for key in (k for k in saved if k in given):
            lines += _differences(f"{path}.{key}", saved[key], given[key], ignored)
        return lines
    if saved == given:
        return []
    return [(path, f"{path}: {_render(saved)} -> {_render(given)}")]


def _render(value: Any, limit: int = 80) -> str:
    """A value on one short line, as YAML's flow style writes it (`absent` for no key); a long
    section or list ends in `...` after the items that fit in `limit` characters."""
    if value is _ABSENT:
        return "absent"
    if isinstance(value, (dict, list)):
        items = (
            [f"{k}: {_render(v)}" for k, v in value.items()]
            if isinstance(value, dict)
            else list(map(_render, value))
        )
        shown = []
        for item in items:
            if shown and len(", ".join([*shown, item])) > limit:
                shown.append("...")
                break
            shown.append(item)
        opening, closing = "{}" if isinstance(value, dict) else "[]"
        return opening + ", ".join(shown) + closing
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str) and not re.fullmatch(r"[\w.:/+-]+", value):
        return repr(value)
    return str(value)


def typed_config(overrides: list[str], **kwargs) -> Config:
    """compose_config(...) as the schema's dataclasses (what the builders and the engine read)."""
    return to_typed(compose_config(overrides, **kwargs))
