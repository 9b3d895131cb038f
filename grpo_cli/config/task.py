"""Defaults that follow the task: the completion length and the rewards a run gets when the user
sets neither are the task's own, declared by its data source (grpo_cli/data: Facts.max_new_tokens,
Facts.rewards) or by its environment style (grpo_cli/environments/styles: Facts), not the
arithmetic demo's 16 tokens and short-answer rewards.

    data=arithmetic (the default)   16 tokens, reward [accuracy, format]  (unchanged)
    data=jsonl, hub, gsm8k, mix     256 tokens, reward [accuracy]
    data=reasoning_gym              256 tokens, reward [reasoning_gym]
    environment.style=trl|text_gym  the data's length; reward [environment]

Two mechanisms, one source (`task_facts`):
- the length is the schema's default `${grpo_task:max_new_tokens}`, an interpolation this module's
  resolver answers from the composed config, so every reader of the config gets the task's value
  and `grpo-train --cfg job` shows where it comes from (`--resolve`: the number);
- the rewards are the defaults list's `reward: [accuracy, format]` swapped for the task's after
  composing (`apply`), only where the user chose no rewards: no `reward=...`, no
  `reward.accuracy.*` / `reward.format.*` key and no `experiment=...` on the command line. A reward
  of the user's added beside them (`+reward.mine.fn=...`) stays. grpo-train says so in one note,
  and its --cfg job prints the config after the swap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

#: the defaults list's reward choice (conf/config.yaml), which a task's own rewards replace
DEMO_REWARDS = ("accuracy", "format")
#: the length where the task's source cannot be loaded (validation then names the bad source)
FALLBACK_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class TaskFacts:
    """What the task declares: max_new_tokens, rewards (its correctness reward first), and who
    declared them (`data.source=jsonl`, `environment.style=trl`), as notes say it."""

    max_new_tokens: int
    rewards: tuple[str, ...]
    declared_by: str


def task_facts(data_source: str, environment: Any | None) -> TaskFacts:
    """The task's defaults: its data source's, with an environment style's where it declares
    its own. Raises UserError where the source or style cannot be loaded."""
    from grpo_cli import data
    from grpo_cli.environments import styles

    facts = data.plugin(data_source).facts
    out = TaskFacts(facts.max_new_tokens, tuple(facts.rewards), f"data.source={data_source}")
    if environment is not None and _has_environment(environment):
        style = styles.plugin(str(environment.style)).facts
        if style.rewards is not None:
            out = TaskFacts(
                out.max_new_tokens, tuple(style.rewards), f"environment.style={environment.style}"
            )
        if style.max_new_tokens is not None:
            out = TaskFacts(style.max_new_tokens, out.rewards, f"environment.style={environment.style}")
    return out


def _has_environment(env: Any) -> bool:
    return env.get("fn") is not None or bool(env.get("tools"))


def resolve_max_new_tokens(key: str, _root_: DictConfig) -> int:
    """The `grpo_task` resolver: `${grpo_task:max_new_tokens}` is the task's completion length."""
    from grpo_cli.errors import UserError

    if key != "max_new_tokens":
        raise ValueError(f"grpo_task knows max_new_tokens only, not {key!r}")
    try:
        return task_facts(str(_root_.data.source), _root_.get("environment")).max_new_tokens
    except UserError:  # an unknown data.source or style: validation reports it
        return FALLBACK_MAX_NEW_TOKENS


def user_chose_rewards(overrides: list[str]) -> bool:
    """Whether the command line chooses the rewards: `reward=...` (the group), a key of the
    default rewards (`reward.accuracy.strict=false` keeps them), or an experiment (it chooses its
    own)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        key = key.split("@", 1)[0].strip()
        if key == "experiment" and value.strip() not in ("", "null"):  # (~experiment, =null: none)
            return True
        if key == "reward" or any(
            key == f"reward.{n}" or key.startswith(f"reward.{n}.") for n in DEMO_REWARDS
        ):
            return True
    return False


def apply(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """Replace the default rewards by the task's where the user chose none (in place); the notes
    that say so (empty: nothing changed)."""
    from grpo_cli.errors import UserError

    if user_chose_rewards(overrides) or "reward" not in cfg:
        return []
    names = list(cfg.reward.keys())
    if [n for n in names if n in DEMO_REWARDS] != list(DEMO_REWARDS):
        return []  # a primary config of the user's chose other rewards
    try:
        facts = task_facts(str(cfg.data.source), cfg.get("environment"))
    except UserError:
        return []  # validation reports the bad source or style
    if facts.rewards == DEMO_REWARDS:
        return []
    others = {n: cfg.reward[n] for n in names if n not in DEMO_REWARDS}
    with open_dict(cfg):  # (a reward the config already holds keeps its node, set in a file or not)
        cfg.reward = {**{n: cfg.reward[n] if n in names else reward_node(n) for n in facts.rewards}, **others}
    return [
        f"{facts.declared_by} scores with reward=[{','.join(facts.rewards)}] (its task's; not the "
        f"arithmetic demo's [{','.join(DEMO_REWARDS)}]); choose others with reward=[...]."
    ]


def reward_node(name: str) -> DictConfig:
    """A built-in reward's config node as `reward=[name]` composes it: its typed schema (every
    option at its default) under its preset's values (conf/reward/<name>.yaml)."""
    from importlib.resources import files

    from grpo_cli.config import reward_node as typed_node
    from grpo_cli.errors import UserError
    from grpo_cli.rewards import REGISTRY

    if name not in REGISTRY:
        raise UserError(
            f"the task declares the reward {name!r} (its plug-in's Facts.rewards), which is not a built-in "
            f"reward ({', '.join(REGISTRY)}); declare built-in names there, or choose the rewards with reward=[...]."
        )
    declared = REGISTRY[name]
    node = (
        OmegaConf.structured(typed_node(name, declared.options)) if declared.options else OmegaConf.create()
    )
    preset = OmegaConf.load(str(files("grpo_cli.conf") / "reward" / f"{name}.yaml"))
    return OmegaConf.merge(node, preset.get(name) or {})
