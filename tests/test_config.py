"""Tier 2: every shipped config composes, and every validation rule fires with a useful message."""

from __future__ import annotations

import pytest
from conftest import CONF
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from grpo_cli.config import validate

GROUPS = ["model", "data", "reward", "sampler", "loss", "optimizer", "trainer"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_composes(compose, group, option):
    override = f"{group}=[{option}]" if group == "reward" else f"{group}={option}"
    extra = ["data.path=x.jsonl"] if (group, option) == ("data", "jsonl") else []
    cfg = compose([override] + extra)
    assert cfg[group] is not None
    assert validate(cfg) == [], f"shipped preset {group}/{option} does not validate"


def test_every_group_has_a_folder():
    for group in GROUPS:
        assert list((CONF / group).glob("*.yaml")), f"conf/{group}/ has no presets"


def test_design_card_command_line(compose):
    cfg = compose(["model=qwen0.5b", "reward=[accuracy,format]", "loss.beta=0.04"])
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert set(cfg.reward) == {"accuracy", "format"}
    assert cfg.loss.beta == 0.04
    assert validate(cfg) == []


def test_reward_group_is_multi_select_with_own_weights(compose):
    cfg = compose(["reward=[accuracy,format,length]", "reward.format.weight=0.2"])
    assert list(cfg.reward) == ["accuracy", "format", "length"]
    assert cfg.reward.format.weight == 0.2
    assert cfg.reward.accuracy.weight == 1.0


@pytest.mark.parametrize(
    "override",
    [
        "loss.beta=abc",
        "loss.bet=0.1",
        "sampler.num_generations=eight",
        "trainer.max_steps=1.5",
        "model=no_such_model",
    ],
    ids=["wrong-type", "misspelt-key", "wrong-int", "float-for-int", "unknown-option"],
)
def test_bad_values_fail_at_compose_time(compose, override):
    with pytest.raises((HydraException, OmegaConfBaseException)) as info:
        compose([override])
    key, value = override.split("=")
    message = str(info.value) + str(info.value.__cause__ or "")
    assert key in message or value in message, message


# Each row: overrides, a fragment the message must contain (the bad value), and a fix fragment.
VALIDATION_CASES = [
    (["sampler.num_generations=1"], "sampler.num_generations=1", ">= 2"),
    (["loss.epsilon=0"], "loss.epsilon=0", "(0, 1)"),
    (["loss.epsilon=1.5"], "loss.epsilon=1.5", "(0, 1)"),
    (["loss.epsilon_high=2"], "loss.epsilon_high=2", "0.28"),
    (["loss.beta=-0.1"], "loss.beta=-0.1", "use 0"),
    (["sampler.temperature=0"], "sampler.temperature=0", "> 0"),
    (["sampler.top_p=0"], "sampler.top_p=0", "(0, 1]"),
    (["sampler.max_new_tokens=0"], "sampler.max_new_tokens=0", "positive"),
    (["sampler.max_prompt_length=-3"], "sampler.max_prompt_length=-3", "positive"),
    (["trainer.max_steps=0"], "trainer.max_steps=0", "positive"),
    (["trainer.save_steps=0"], "trainer.save_steps=0", "positive"),
    (
        ["trainer.prompts_per_step=3", "trainer.gradient_accumulation_steps=2"],
        "prompts_per_step=3",
        "whole groups",
    ),
    (["reward=[]"], "no reward", "reward=[accuracy,format]"),
    (["loss.loss_type=ppo"], "loss.loss_type='ppo'", "grpo, bnpo, dr_grpo, dapo"),
    (["loss.kl_estimator=k4"], "loss.kl_estimator='k4'", "k1, k2, k3"),
    (["loss.scale_rewards=global"], "loss.scale_rewards='global'", "group, batch, none"),
    (["optimizer.lr_scheduler=step"], "optimizer.lr_scheduler='step'", "constant, linear, cosine"),
    (["optimizer.learning_rate=0"], "optimizer.learning_rate=0", "> 0"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'", "fp32"),
    (["data.max_operand=3", "data.num_examples=1000"], "1200 exceeds", "raise max_operand"),
    (["data=jsonl"], "data.path", "needs data.path"),
    (["reward.accuracy.weight=heavy"], "reward.accuracy.weight", "'heavy'"),
    (["reward.accuracy.extract=bogus"], "bogus", "last_number"),
    (["+reward.mine.fn=no_such_module:fn"], "no_such_module", "PYTHONPATH"),
]


@pytest.mark.parametrize(
    "overrides,bad,fix", VALIDATION_CASES, ids=[" ".join(c[0]) for c in VALIDATION_CASES]
)
def test_validation_names_bad_value_and_fix(compose, overrides, bad, fix):
    if overrides == ["data=jsonl"]:
        overrides = ["data=jsonl", "data.path=null"]
    problems = validate(compose(overrides))
    assert problems, f"{overrides} should be rejected"
    text = "\n".join(problems)
    assert bad in text and fix in text, text


def test_validation_reports_every_problem_at_once(compose):
    problems = validate(
        compose(["loss.beta=-1", "sampler.num_generations=1", "loss.loss_type=x", "sampler.temperature=-1"])
    )
    assert len(problems) == 4, problems


TYPED_GROUPS = ["data", "sampler", "loss", "optimizer", "trainer"]


@pytest.mark.parametrize("group", TYPED_GROUPS)
def test_the_schema_is_the_one_source_of_every_default(compose, group):
    """The shipped default config and the schema alone agree on every key of every typed group:
    a default option's YAML restates nothing, so a user's own preset that leaves a key out gets
    the same value as the shipped one."""
    from omegaconf import OmegaConf

    from grpo_cli.config import Config

    shipped = OmegaConf.to_container(compose([])[group], resolve=True)
    schema = OmegaConf.to_container(OmegaConf.structured(Config)[group], resolve=True)
    assert shipped == schema


@pytest.mark.parametrize("group", TYPED_GROUPS)
def test_presets_set_only_what_they_change(group):
    """Every key a shipped preset sets differs from the schema's default (no second source)."""
    import yaml
    from omegaconf import OmegaConf

    from grpo_cli.config import Config

    schema = OmegaConf.to_container(OmegaConf.structured(Config)[group])
    for path in sorted((CONF / group).glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        for key, value in values.items():
            if key == "defaults":
                continue
            assert key in schema, f"{path.name}: {key} is not a key of {group}"
            assert value != schema[key], f"{path.name} restates the schema's default {group}.{key}={value!r}"
