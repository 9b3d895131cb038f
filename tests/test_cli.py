"""Tier 4: the installed console scripts, run in a subprocess from outside the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import console_script, run_cli

# Console scripts and end-to-end runs: the slow tier (pytest -m "not slow" skips them).
pytestmark = pytest.mark.slow


def test_cfg_job_prints_composed_config(tmp_path):
    res = run_cli(
        [
            console_script("grpo-train"),
            "--cfg",
            "job",
            "model=qwen0.5b",
            "reward=[accuracy,format]",
            "loss.beta=0.04",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["model"]["name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert set(cfg["reward"]) == {"accuracy", "format"}
    assert cfg["loss"]["beta"] == 0.04
    assert list(tmp_path.iterdir()) == [], "--cfg job must not write anything"


def test_bad_value_is_a_friendly_error_with_exit_2_and_no_artefacts(tmp_path):
    res = run_cli([console_script("grpo-train"), "loss.beta=-1", "sampler.num_generations=1"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert "loss.beta=-1.0" in res.stderr and "sampler.num_generations=1" in res.stderr
    assert list(tmp_path.rglob("*")) == [], "a rejected config must leave no run folder behind"


def test_compose_error_exits_2_without_traceback(tmp_path):
    res = run_cli([console_script("grpo-train"), "loss.beta=abc"], cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "'abc'" in res.stderr
    assert list(tmp_path.rglob("*")) == []


def test_user_config_dir_adds_a_preset(tmp_path):
    (tmp_path / "my_conf" / "model").mkdir(parents=True)
    (tmp_path / "my_conf" / "model" / "mine.yaml").write_text("name_or_path: /models/mine\n")
    res = run_cli(
        [
            console_script("grpo-train"),
            "--config-dir",
            str(tmp_path / "my_conf"),
            "model=mine",
            "--cfg",
            "job",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["model"]["name_or_path"] == "/models/mine"


def test_check_env_reports_and_exits_0(tmp_path, capsys):
    res = run_cli([console_script("grpo-check-env")], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for needle in (
        "torch",
        "transformers",
        "hydra-core",
        "cuda available",
        "bf16 supported",
        "precision",
        "cpu cores",
        "status: OK",
    ):
        assert needle in res.stdout, needle
    # --json: the same report as JSON (in this process: the console script ran above).
    from grpo_cli.cli import check_env

    capsys.readouterr()
    check_env.main(["--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["packages"]["torch"] and info["recommended_precision"] in ("fp32", "bf16", "fp16")
    assert info["cpu_cores"] >= 1


def test_check_env_fails_on_a_broken_package(tmp_path):
    broken = tmp_path / "shadow" / "datasets"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    res = run_cli(
        [console_script("grpo-check-env")], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "shadow")}
    )
    assert res.returncode == 1
    assert "datasets" in res.stdout and "simulated broken install" in res.stdout


def test_multirun_composes_two_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_cli(
        [
            console_script("grpo-train"),
            "-m",
            "loss.beta=0,0.04",
            "model=tiny",
            "trainer=smoke",
            "trainer.max_steps=1",
            # (a tiny step: what is checked is the jobs' composed configs)
            "data.num_examples=16",
            "data.eval_size=4",
            "sampler.num_generations=2",
            "sampler.max_new_tokens=4",
            "trainer.prompts_per_step=1",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    betas = sorted(
        yaml.safe_load((sweep / str(i) / "config.yaml").read_text())["loss"]["beta"] for i in range(2)
    )
    assert betas == [0.0, 0.04]


def test_reward_test_prints_a_table_of_each_reward(tmp_path):
    res = run_cli(
        [
            console_script("grpo-reward-test"),
            "reward=[accuracy,format]",
            "-c",
            "47",
            "-c",
            "47 or 48",
            "-c",
            "470",
            "--column",
            "answer=47",
        ],
        cwd=tmp_path,
        env={"COLUMNS": "150"},
    )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if "'47'" in line or "'470'" in line or "or 48" in line]
    cells = [[c.strip() for c in line.split("│") if c.strip()] for line in lines]
    assert cells[0][-3:] == ["1", "0.2", "1.2"]  # right answer, short with a number
    assert cells[1][-3:] == ["0", "0.2", "0.2"]  # two different answers: strict accuracy gives 0
    assert cells[2][-3:] == ["0", "0.2", "0.2"]  # 470 is not 47


def test_reward_test_reads_a_file_and_reports_unknown_rewards(tmp_path):
    cases = tmp_path / "cases.jsonl"
    cases.write_text('{"completion": "\\\\boxed{3/4}", "answer": "0.75"}\n')
    res = run_cli(
        [console_script("grpo-reward-test"), "reward=[accuracy]", "--file", str(cases)],
        cwd=tmp_path,
        env={"COLUMNS": "150"},
    )
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if "boxed" in line)
    assert [c.strip() for c in row.split("│") if c.strip()][-2:] == ["1", "1"]  # 3/4 == 0.75
    res = run_cli([console_script("grpo-reward-test"), "reward=[nope]", "-c", "1"], cwd=tmp_path)
    assert res.returncode == 2 and "accuracy, environment, format, judge, length, model" in res.stderr
    assert "Traceback" not in res.stderr


def test_reward_test_uses_a_user_reward_yaml_from_config_dir(tmp_path):
    from conftest import ROOT

    (tmp_path / "conf" / "reward").mkdir(parents=True)
    (tmp_path / "conf" / "reward" / "code.yaml").write_text(
        "code:\n  fn: reward_fixtures:char_code\n  weight: 0.5\n"
    )
    res = run_cli(
        [
            console_script("grpo-reward-test"),
            "reward=[accuracy,code]",
            "--config-dir",
            str(tmp_path / "conf"),
            "-c",
            "12",
            "--column",
            "answer=12",
        ],
        cwd=tmp_path,
        env={"COLUMNS": "150", "PYTHONPATH": str(ROOT / "tests")},
    )
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if "'12'" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    code = float(sum(map(ord, "12")) % 7)
    assert cells[-3:] == ["1", f"{code:g}", f"{1 + 0.5 * code:g}"]


def test_reward_test_replays_an_episode(tmp_path):
    """grpo-reward-test on a conversation (an episode's messages and the environment's reward):
    the accuracy reward grades the assistant's last answer, a user reward reads env_reward."""
    (tmp_path / "conf" / "reward").mkdir(parents=True)
    (tmp_path / "conf" / "reward" / "env.yaml").write_text("env:\n  fn: reward_fixtures:environment_reward\n")
    episode = [
        {"role": "assistant", "content": "<calc>12-17</calc>"},
        {"role": "tool", "content": "<result>-5</result>"},
        {"role": "assistant", "content": "-5"},
    ]
    cases = tmp_path / "cases.jsonl"
    cases.write_text(
        json.dumps({"completion": episode, "answer": "-5", "env_reward": 0.5})
        + "\n"
        + json.dumps(
            {
                "completion": episode[:2] + [{"role": "assistant", "content": "5"}],
                "answer": "-5",
                "env_reward": 0.0,
            }
        )
        + "\n"
    )
    res = run_cli(
        [
            console_script("grpo-reward-test"),
            "reward=[accuracy,env]",
            "--config-dir",
            str(tmp_path / "conf"),
            "--file",
            str(cases),
            "--chat",
        ],
        cwd=tmp_path,
        env={"COLUMNS": "200", "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert res.returncode == 0, res.stderr
    rows = [
        [c.strip() for c in line.split("│") if c.strip()]
        for line in res.stdout.splitlines()
        if "calc" in line
    ]
    assert [r[-3:] for r in rows] == [["1", "0.5", "1.5"], ["0", "0", "0"]]


def test_the_wheel_ships_every_package_of_the_source_tree(monkeypatch):
    """The packages a wheel ships are the ones setuptools settles on from pyproject.toml (asked here
    as a build asks it: its configuration, then its package discovery): every package of the source
    tree must be among them, and conf/ as grpo_cli.conf with its YAML files. A subpackage left out
    installs everywhere but in an editable checkout (a wheel, the lent machine's offline install).
    (setuptools: torch requires it.)"""
    import glob
    import warnings

    from conftest import ROOT
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # (setuptools reads ./pyproject.toml and resolves package-dir from here)
    dist = Distribution()
    with warnings.catch_warnings():  # (deprecations of pyproject fields unrelated to packages)
        warnings.simplefilter("ignore")
        dist.parse_config_files()
        dist.set_defaults(name=False)  # the discovery a build runs where `packages` is not given
    shipped = set(dist.packages or ())
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "grpo_cli").rglob("__init__.py")}
    missing = sorted((found | {"grpo_cli.conf"}) - shipped)
    assert not missing, f"the wheel would leave out {missing}: see [tool.setuptools] in pyproject.toml"
    assert (ROOT / dist.package_dir["grpo_cli.conf"]).resolve() == ROOT / "conf"
    conf = ROOT / "conf"
    data = {
        f for pat in dist.package_data["grpo_cli.conf"] for f in glob.glob(pat, root_dir=conf, recursive=True)
    }
    yamls = {p.relative_to(conf).as_posix() for p in conf.rglob("*.yaml")}
    assert yamls and yamls <= data, f"conf/ files the wheel would leave out: {sorted(yamls - data)}"
