"""Defaults that follow the task (grpo_cli/config/task.py): the completion length and the rewards
a run gets where the user sets neither are its data source's or environment style's; the user's
choice always wins; `--cfg job` shows what a run composes (every job of a sweep); a key that
cannot act is said; a module in the working directory is importable by `fn=`; the math accuracy
reward refuses text answers before any model loads."""

from __future__ import annotations

import sys
import textwrap

import pytest
from conftest import CONF
from omegaconf import OmegaConf

from grpo_cli.cli import train as train_cli
from grpo_cli.config import inert_settings, task, validate
from grpo_cli.errors import UserError

MINE = "+reward.mine.fn=grpo_cli.rewards.length:length"


@pytest.mark.parametrize(
    "overrides, max_new_tokens, rewards",
    [
        ([], 16, ["accuracy", "format"]),  # the arithmetic demo: unchanged
        (["data=jsonl", "data.path=x.jsonl"], 256, ["accuracy"]),
        (["data=gsm8k"], 256, ["accuracy"]),
        (["data=mix"], 256, ["accuracy"]),
        (["data=reasoning_gym"], 256, ["reasoning_gym"]),
        (["environment=calculator"], 16, ["accuracy", "format"]),  # native: the data's
        (["environment.style=trl", "environment.fn=pkg.envs:Env"], 16, ["environment"]),
        (["data=jsonl", "environment.style=text_gym", "environment.fn=gsm8k"], 256, ["environment"]),
        # the user's choice wins, for either
        (["data=jsonl", "sampler.max_new_tokens=32"], 32, ["accuracy"]),
        (["data=jsonl", "reward=[accuracy,format]"], 256, ["accuracy", "format"]),
        (["data=jsonl", "reward.format.max_chars=40"], 256, ["accuracy", "format"]),
        (["data=reasoning_gym", "reward=[accuracy]"], 256, ["accuracy"]),
        (["data=jsonl", MINE], 256, ["accuracy", "mine"]),  # beside the task's
        (["data=jsonl", "reward=[]", MINE], 256, ["mine"]),  # the user's alone
        (["experiment=gsm8k"], 512, ["accuracy", "format"]),  # an experiment's own
    ],
)
def test_the_task_declares_its_length_and_rewards(compose, overrides, max_new_tokens, rewards):
    cfg = compose(overrides)
    assert cfg.sampler.max_new_tokens == max_new_tokens
    assert list(cfg.reward) == rewards
    assert f"max_new_tokens: {max_new_tokens}\n" in OmegaConf.to_yaml(cfg, resolve=True)  # the run record


@pytest.mark.parametrize("name", ["accuracy", "format", "reasoning_gym", "environment"])
def test_a_task_reward_is_the_node_its_preset_composes(compose, name):
    """The node a task's default builds equals what `reward=[name]` composes (its typed schema
    under conf/reward/<name>.yaml), so `reward.<name>.<option>=` means the same either way."""
    assert OmegaConf.to_container(task.reward_node(name)) == OmegaConf.to_container(
        compose([f"reward=[{name}]"]).reward[name]
    )


def test_every_data_preset_composes_its_task_and_validates(compose):
    for preset in sorted(p.stem for p in (CONF / "data").glob("*.yaml")):
        cfg = compose([f"data={preset}"])
        facts = task.task_facts(str(cfg.data.source), cfg.environment)
        assert cfg.sampler.max_new_tokens == facts.max_new_tokens, preset
        assert tuple(cfg.reward) == facts.rewards, preset


def test_a_users_data_source_in_the_working_directory_declares_its_task(compose, tmp_path, monkeypatch):
    """data.source=my_source:PLUGIN: a module of the user's, found in the working directory (not on the
    import path), declares 64 tokens and the length reward; both reach the composed config."""
    (tmp_path / "my_source.py").write_text(
        textwrap.dedent(
            """
            from grpo_cli.data import Facts
            from grpo_cli.plugins import Plugin

            PLUGIN = Plugin(
                name="my_source",
                build=lambda d, seed, options: ([{"prompt": "hi", "answer": "1"}], []),
                facts=Facts(max_new_tokens=64, rewards=("length",)),
            )
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_source", raising=False)
    cfg = compose(["data.source=my_source:PLUGIN"])
    assert cfg.sampler.max_new_tokens == 64 and list(cfg.reward) == ["length"]
    assert sys.path[0] == str(tmp_path)  # put first, once, as `python -m` does


def test_the_working_directory_is_added_only_for_a_module_that_is_there(tmp_path, monkeypatch):
    from grpo_cli.plugins import import_user_module

    monkeypatch.chdir(tmp_path)
    before = [p for p in sys.path if p not in ("", str(tmp_path))]
    monkeypatch.setattr(sys, "path", list(before))
    with pytest.raises(ModuleNotFoundError):
        import_user_module("no_such_module_here")
    assert sys.path == before
    import_user_module("json")  # importable anyway: the path is left alone
    assert sys.path == before


@pytest.mark.parametrize(
    "argv, shown, absent",
    [
        (["--cfg", "job", "data=jsonl", "data.path=x.jsonl"], ["reward:\n  accuracy:"], ["format:"]),
        (["--cfg", "job", "--resolve", "data=reasoning_gym"], ["max_new_tokens: 256", "reasoning_gym:"], []),
        (["--cfg", "job"], ["max_new_tokens: ${grpo_task:max_new_tokens}"], []),  # where it comes from
        (
            ["--cfg", "job", "-m", "loss.beta=0,0.04", "trainer.num_iterations=2"],
            ["# job 0: loss.beta=0 trainer.num_iterations=2", "# job 1: loss.beta=0.04", "beta: 0.04"],
            [],
        ),
    ],
)
def test_cfg_job_prints_what_each_job_composes(capsys, argv, shown, absent):
    assert train_cli._print_job_configs(argv)
    out = capsys.readouterr().out
    for text in shown:
        assert text in out
    for text in absent:
        assert text not in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--cfg", "hydra", "-m", "loss.beta=0,0.04"], "cannot be combined with -m"),
        (["--cfg", "job", "loss.bta=1"], "loss.bta"),
    ],
)
def test_cfg_job_refusals_are_one_paragraph(capsys, argv, expected):
    with pytest.raises(SystemExit) as stopped:
        train_cli._print_job_configs(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_without_cfg_hydra_runs_as_before():
    assert not train_cli._print_job_configs(["loss.beta=0.04"])
    assert not train_cli._print_job_configs(["--cfg", "hydra"])  # Hydra's own printer


@pytest.mark.parametrize(
    "overrides, keys, inert",
    [
        ([], ["loss.epsilon"], ["loss.epsilon"]),
        ([], ["loss.epsilon_high", "loss.beta"], ["loss.epsilon_high"]),
        (["trainer.num_iterations=2"], ["loss.epsilon"], []),
        ([], ["loss.beta"], []),
    ],
)
def test_a_key_that_cannot_act_is_said(compose, overrides, keys, inert):
    notes = inert_settings(compose(overrides), keys)
    assert [n.split(" ", 1)[0] for n in notes] == inert


@pytest.mark.parametrize(
    "answers, refused",
    [
        (["12", "#### 72", "-5", "\\frac{1}{2}", "3.5"], False),
        (["olleh", "12"], True),
        (["True", "False"], True),
    ],
)
def test_the_math_accuracy_refuses_text_answers_before_the_run(answers, refused):
    from grpo_cli.rewards import build_rewards, check_reward_columns

    rows = [{"prompt": "q", "answer": a} for a in answers]
    rewards = build_rewards(OmegaConf.create({"accuracy": {"weight": 1.0}}))
    data = OmegaConf.create({"path": "x.jsonl", "source": "file", "prompt_column": "prompt"})
    if not refused:
        check_reward_columns(rewards, rows, data)
        return
    with pytest.raises(UserError) as err:
        check_reward_columns(rewards, rows, data)
    assert "reward=[reasoning_gym]" in str(err.value) and repr(answers[0]) in str(err.value)


def test_task_defaults_validate(compose):
    pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed (the oldest leg)")
    assert validate(compose(["data=reasoning_gym"])) == []


def test_the_readmes_own_reward_command_runs_from_the_users_folder(tmp_path):
    """README "Your own task": `grpo-train data=jsonl data.path=my_data.jsonl 'reward=[]'
    +reward.mine.fn=my_rewards:mine`, run as a user runs it, from the folder that holds
    my_rewards.py (no PYTHONPATH): the user's reward alone scores, at the file's 256 tokens."""
    import json

    from conftest import grpo

    rows = [{"prompt": f"What is {a} plus 1?", "answer": str(a + 1)} for a in range(12)]
    (tmp_path / "my_data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(
        "def mine(completions, answer, **kwargs):\n    return [float(len(c) % 3) for c in completions]\n"
    )
    command = ["data=jsonl", "data.path=my_data.jsonl", "reward=[]", "+reward.mine.fn=my_rewards:mine"]
    small = ["model=tiny", "trainer.max_steps=1", "trainer.prompts_per_step=2", "sampler.num_generations=2"]
    quiet = ["trainer.eval_before=false", "data.eval_size=0", "trainer.quiet=true", "hydra.run.dir=run"]
    done = grpo([*command, *small, *quiet], tmp_path, env={"PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert list(saved.reward) == ["mine"] and saved.sampler.max_new_tokens == 256
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/mine/mean" in metrics[-1]


@pytest.mark.parametrize(
    "overrides, chose",
    [
        (["reward=[accuracy]"], True),
        (["reward.accuracy.strict=false"], True),
        (["+reward.format.max_chars=40"], True),
        (["~reward.format"], True),
        (["experiment=gsm8k"], True),
        (["+reward.accuracy_text.fn=m:f"], False),  # a reward of the user's, not accuracy's key
        (["+reward.formatting.fn=m:f"], False),
        (["experiment=null"], False),
        (["~experiment"], False),
        (["loss.beta=0.04"], False),
    ],
)
def test_what_counts_as_choosing_the_rewards(overrides, chose):
    assert task.user_chose_rewards(overrides) is chose


def test_a_kept_task_reward_keeps_its_node(compose):
    """The swap rebuilds only the rewards the config lacks: accuracy's settings, from whatever set
    them (a config file of the user's), stay when the file's task keeps [accuracy]."""
    cfg = compose([])  # the arithmetic default: [accuracy, format], nothing swapped
    cfg.data.source, cfg.data.path = "file", "x.jsonl"
    cfg.reward.accuracy.answer_column = "gold"
    assert task.apply(cfg, []) and list(cfg.reward) == ["accuracy"]
    assert cfg.reward.accuracy.answer_column == "gold"


def test_a_task_that_declares_an_unknown_reward_is_one_paragraph():
    with pytest.raises(UserError, match="not a built-in reward"):
        task.reward_node("no_such_reward")
