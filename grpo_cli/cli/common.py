"""What the commands share: composing the shipped config (plus a user's config folder or a
checkpoint's saved config), validating it, and reporting failures as one short paragraph."""

from __future__ import annotations

import sys
from pathlib import Path

from grpo_cli.config import Config, to_typed, validate
from grpo_cli.config.renamed import apply_renames
from grpo_cli.errors import UserError


def compose_config(
    overrides: list[str], *, checkpoint: str | None = None, config_dir: str | None = None, check: bool = True
):
    """The shipped config with `overrides` (a DictConfig), as grpo-train composes it.

    config_dir: a folder of the user's own config groups, added to the shipped ones (as
    grpo-train --config-dir does). checkpoint: a grpo-cli checkpoint folder; its saved config (its
    data, sampler and reward settings) with key=value overrides on top, and the checkpoint as the
    model (a LoRA checkpoint: its adapter on config.yaml's base model). check: validate the
    whole config (every problem in one UserError).
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        if checkpoint:
            saved = Path(checkpoint) / "config.yaml"
            if not saved.is_file():
                raise UserError(
                    f"--checkpoint {checkpoint!r} has no config.yaml; give a grpo-cli "
                    "checkpoint folder (outputs/.../checkpoints/step-N), or evaluate a plain "
                    "model folder with model.name_or_path=DIR."
                )
            cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(saved))
            presets, keys = _checkpoint_overrides(overrides)
            if presets:  # group=option: that section becomes the preset, as grpo-train composes it
                with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
                    shipped = compose(config_name="config", overrides=presets)
                for override in presets:
                    group = override.split("=", 1)[0]
                    cfg[group] = shipped[group]
            cfg.merge_with_dotlist(keys)  # key=value overrides after the presets
            # Evaluating or exporting logs to no tracker (the run's W&B may not be installed or
            # logged in here), and a setting its run ignored (a sweep's adapter.r with adapter=none)
            # stays ignored: neither is a problem for this checkpoint.
            cfg.trainer.report_to = ["jsonl"]
            if cfg.adapter.name != "none":  # base model (config.yaml's) + the checkpoint's adapter
                cfg.adapter.path = str(Path(checkpoint).resolve())
            else:  # the checkpoint is the full model
                cfg.model.name_or_path = str(Path(checkpoint).resolve())
                cfg.model.gguf_file = None
        else:
            if config_dir:
                overrides = overrides + [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
            with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
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
    if check:
        problems = validate(cfg, unused_ok=bool(checkpoint))
        if problems:
            raise UserError("invalid configuration: " + " ".join(problems))
    return cfg


def _checkpoint_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """A saved config's overrides, split into group=option (a section replaced by its preset) and
    key=value; a UserError, naming them, for the forms that do not apply to a saved config."""
    from dataclasses import fields

    groups = [f.name for f in fields(Config)]
    presets, keys, bad = [], [], []
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" not in override or override.startswith(("+", "~")) or "[" in override or key == "experiment":
            bad.append(override)
        elif key in groups:
            presets.append(override)
        else:
            keys.append(override)
    if bad:
        raise UserError(
            f"with --checkpoint these overrides do not apply: {', '.join(bad)}. A checkpoint's saved "
            f"config takes key=value overrides and group=option for one preset of a group "
            f"({', '.join(groups)}); adding (+) or removing (~) keys, lists and experiment= change "
            "what the checkpoint was trained with: set the keys you need one by one instead."
        )
    return presets, keys


def typed_config(overrides: list[str], **kwargs) -> Config:
    """compose_config(...) as the schema's dataclasses (what the builders and the engine read)."""
    return to_typed(compose_config(overrides, **kwargs))
