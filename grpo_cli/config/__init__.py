"""Typed config schemas (Hydra ConfigStore), their registration, and whole-config validation.

The schemas type every group, so `loss.beta=abc` or a misspelt key fails while Hydra composes
the config. They are also the one source of every default: the default option of each group
(`conf/sampler/default.yaml`, `conf/loss/grpo.yaml`, ...) sets nothing the schema does not
already say (a test composes both and compares every key), and the other presets set only what
they change; the experiments (`conf/experiment/`, `grpo-train experiment=gsm8k`) are global presets
that choose options of several groups. `validate(cfg)` checks values and combinations, and that no
key is set that the chosen option ignores, and returns *every* problem at once, before any model
or dataset is loaded. YAML keys equal the parameter names they feed.

Importing this module registers the schema and the `grpo_run_id` resolver (idempotent), so every
command and test that composes a config gets them from here, not from importing a command.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import typing
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from grpo_cli.config.schema import (
    AdapterConfig,
    Config,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    SamplerConfig,
    TrainerConfig,
)
from grpo_cli.config.task import resolve_max_new_tokens
from grpo_cli.config.validation import choices, inert_settings, unused_settings, validate

__all__ = [
    "AdapterConfig",
    "Config",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SamplerConfig",
    "TrainerConfig",
    "choices",
    "inert_settings",
    "register",
    "to_typed",
    "unused_settings",
    "validate",
]

# One id per process: two runs started in the same second get different folders.
RUN_ID = f"{os.getpid()}{secrets.token_hex(2)}"


def reward_node(name: str, options: type) -> type:
    """The typed config node of a built-in reward: the keys every reward has (rewards.base.Node:
    weight, fn, role, workers, call_timeout_s) and the reward's Options dataclass, each the one
    place its keys' defaults live."""
    from grpo_cli.rewards.base import Node  # (the node keys, written once there)

    def typed_fields(record: type) -> list:
        hints = typing.get_type_hints(record)
        return [
            (f.name, hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(record)
        ]

    return dataclasses.make_dataclass(
        f"{name.capitalize()}Reward", typed_fields(Node) + typed_fields(options)
    )


def register() -> None:
    """Register the schema that conf/config.yaml extends (`defaults: [grpo_schema, ...]`), the
    built-in rewards' typed nodes (`reward/<name>_schema`, which conf/reward/<name>.yaml extends:
    a misspelt option or a wrong type fails while Hydra composes, and every option can be set
    without a `+`), the `grpo_run_id` resolver of the run folder names and the `grpo_task` resolver
    of the task's defaults (config/task.py). Idempotent; done when this module loads."""
    from grpo_cli.rewards import REGISTRY  # (each built-in's declaration: rewards.Reward)

    store = ConfigStore.instance()
    store.store(name="grpo_schema", node=Config)
    for name, declared in REGISTRY.items():
        if declared.options is not None:
            store.store(
                group="reward", name=f"{name}_schema", node={name: reward_node(name, declared.options)}
            )
    OmegaConf.register_new_resolver("grpo_run_id", lambda: RUN_ID, replace=True)
    # sampler.max_new_tokens's default, the task's own (config/task.py)
    OmegaConf.register_new_resolver("grpo_task", resolve_max_new_tokens, replace=True)


register()


def to_typed(cfg: Any) -> Config:
    """The composed DictConfig as the schema's dataclasses (interpolations resolved): what the
    engine and the builders read, by attribute name. loss.sampler_correction=auto is resolved
    here, from the chosen sampler backend's facts (samplers.sampler_correction), so the run's config
    shows what ran."""
    from grpo_cli.samplers import sampler_correction

    typed = OmegaConf.to_object(cfg) if not isinstance(cfg, Config) else cfg
    typed.loss.sampler_correction = sampler_correction(typed.loss, typed.sampler)
    return typed
