"""--checkpoint DIR with a run's own command line (issue #58): grpo-eval (and everything that
composes a config with compose_config(..., checkpoint=...)) takes a list, +key, ~key or
experiment= where it changes nothing of the checkpoint's saved config, and refuses it, naming each
difference as `path: saved -> given`, where it does. key=value and group=option apply as before.

One tiny run is trained once (in this process) and every test reads its checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny

#: the run's own command line: a list-valued group (reward) among the tiny model's overrides
RUN = tiny("reward=[accuracy,format]", "trainer.max_steps=1", "data.eval_size=0")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The checkpoint folder of a one-step tiny run trained with RUN, as grpo-train trains it."""
    from grpo_cli.cli.common import compose_config
    from grpo_cli.cli.train import train_config

    run_dir = tmp_path_factory.mktemp("run")
    train_config(compose_config(RUN), run_dir)
    return str(max((run_dir / "checkpoints").iterdir()))


def _saved(checkpoint: str) -> dict:
    """The checkpoint's config.yaml as a plain container (what the run trained with)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(Path(checkpoint) / "config.yaml"))


def _refusal(overrides: list[str], checkpoint: str) -> str:
    """compose_config's UserError for `overrides` on the checkpoint, checked to be one paragraph."""
    from grpo_cli.cli.common import compose_config
    from grpo_cli.errors import UserError

    with pytest.raises(UserError, match="these overrides change what the checkpoint was trained with") as err:
        compose_config(overrides, checkpoint=checkpoint)
    message = str(err.value)
    assert "\n" not in message and "key=value" in message and "train a new run" in message
    return message


def test_the_runs_own_command_line_is_accepted_and_changes_nothing(checkpoint):
    from omegaconf import OmegaConf

    from grpo_cli.cli.common import compose_config, typed_config

    plain = compose_config([], checkpoint=checkpoint)
    again = compose_config(RUN, checkpoint=checkpoint)
    assert OmegaConf.to_container(again.reward) == _saved(checkpoint)["reward"]
    assert list(again.reward) == ["accuracy", "format"]
    assert OmegaConf.to_container(again) == OmegaConf.to_container(plain)  # every key, not only those
    typed = typed_config(RUN, checkpoint=checkpoint)
    assert typed.model.name_or_path == str(Path(checkpoint).resolve())  # still the checkpoint's model


@pytest.mark.parametrize(
    "extra",
    [
        ["trainer.report_to=[jsonl]"],
        ["trainer.report_to=[jsonl,wandb]"],  # the checkpoint logs to jsonl whatever was given
        ["experiment=arithmetic"],  # the default recipe: the run's sections, with its command line
        ["experiment=null"],
        ["~reward.length"],  # absent from the saved config: removing it changes nothing
        ["reward=[format,accuracy]"],  # the same options, another order
    ],
)
def test_lists_experiments_and_removals_that_change_nothing_are_accepted(checkpoint, extra):
    from omegaconf import OmegaConf

    from grpo_cli.cli.common import compose_config

    cfg = compose_config(RUN + extra, checkpoint=checkpoint)
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(compose_config([], checkpoint=checkpoint))
    assert cfg.trainer.report_to == ["jsonl"]


@pytest.mark.parametrize(
    "given, difference",
    [
        ("reward=[accuracy]", "reward: [accuracy, format] -> [accuracy]"),
        ("reward=[accuracy,length]", "reward: [accuracy, format] -> [accuracy, length]"),
        ("reward=[]", "reward: [accuracy, format] -> []"),
    ],
)
def test_a_list_that_differs_is_refused_naming_saved_and_given(checkpoint, given, difference):
    message = _refusal([*RUN, given], checkpoint)
    assert f"{given} ({difference})" in message, message
    assert "reward=[accuracy,format]" not in message  # the run's own list changes nothing


def test_a_list_with_a_key_value_after_it_takes_the_key_as_before(checkpoint):
    """The list is compared with the saved config as the key=value overrides leave it: it changes
    nothing, and the key=value applies as it does alone."""
    from grpo_cli.cli.common import compose_config

    cfg = compose_config([*RUN, "reward.format.value=0.5"], checkpoint=checkpoint)
    assert cfg.reward.format.value == 0.5 and list(cfg.reward) == ["accuracy", "format"]


@pytest.mark.parametrize(
    "given, difference",
    [
        ("+reward.length.weight=1", "reward.length.weight: absent -> 1"),
        ("+trainer.foo=1", "trainer.foo: absent -> 1"),
        ("+reward.length={weight: 1, target: 20}", "reward.length: absent -> {weight: 1, target: 20}"),
    ],
)
def test_adding_a_key_the_saved_config_lacks_is_refused_naming_it(checkpoint, given, difference):
    message = _refusal([*RUN, given], checkpoint)
    assert f"{given} (" in message and difference in message, message
    assert "reward=[accuracy,format]" not in message


def test_removing_a_saved_key_is_refused_and_an_absent_one_accepted(checkpoint):
    from grpo_cli.cli.common import compose_config

    message = _refusal([*RUN, "~reward.format"], checkpoint)
    assert "~reward.format (reward: [accuracy, format] -> [accuracy]; reward.format: {weight: 1.0," in message
    assert "...} -> absent)" in message and "reward=[accuracy,format]" not in message
    assert "loss.beta: 0.0 -> absent" in _refusal(["~loss.beta"], checkpoint)
    cfg = compose_config(["~reward.length", "~data.no_such_key"], checkpoint=checkpoint)
    assert list(cfg.reward) == ["accuracy", "format"]


def test_an_experiment_that_differs_is_refused_on_the_keys_it_sets(checkpoint):
    message = _refusal([*RUN, "experiment=gsm8k"], checkpoint)
    assert "composes them): experiment=gsm8k (" in message
    assert "data.source: arithmetic -> hub" in message  # a group it chooses: the whole section
    assert "reward=[accuracy,format]" not in message  # the experiment sets reward.format, not the list
    assert " more). " in message  # 17 differences: the first 12 are named, the rest counted
    # The command line's group choices win over the experiment's (data, loss: the run's); its own keys
    # win over the command line's groups (reward.format), and the command line's keys over them.
    message = _refusal([*RUN, "experiment=gsm8k", "data=arithmetic", "loss=grpo"], checkpoint)
    assert "optimizer.learning_rate: 7.5e-06 -> 1e-06" in message and "trainer.max_steps" not in message
    assert "reward.format.max_chars: 16 -> null" in message and "sampler.max_new_tokens" not in message
    assert "data." not in message and "loss." not in message and " more" not in message


def test_key_value_and_group_option_apply_as_before(checkpoint):
    from grpo_cli.cli.common import typed_config
    from grpo_cli.config.schema import LossConfig

    cfg = typed_config(
        ["sampler=default", "loss=dapo", "sampler.top_k=3", "reward.format.value=0.3"], checkpoint=checkpoint
    )
    assert cfg.sampler.top_k == 3 and cfg.loss.loss_type == "dapo" != LossConfig().loss_type
    assert cfg.reward["format"]["value"] == 0.3
    assert cfg.sampler.max_new_tokens != 8  # the preset's, not the saved 8: the section is replaced
    assert cfg.model.name_or_path == str(Path(checkpoint).resolve())


def test_a_word_that_is_no_override_is_refused(checkpoint):
    from grpo_cli.cli.common import compose_config
    from grpo_cli.errors import UserError

    with pytest.raises(UserError, match="with --checkpoint these are not overrides: accuracy"):
        compose_config(["accuracy"], checkpoint=checkpoint)
