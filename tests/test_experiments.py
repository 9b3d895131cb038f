"""Experiment presets (conf/experiment/): each composes and validates, `arithmetic` is the default
recipe exactly, `gsm8k` holds the values it promises and its rewards pay what it says, and the
command line wins over an experiment, for keys and group choices alike."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import yaml
from conftest import CONF
from omegaconf import OmegaConf

from grpo_cli.config import validate
from grpo_cli.data.reasoning_gym import MISSING_PACKAGE

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# The groups typed by the schema, whose keys an experiment may set beyond its group choices.
TYPED = ["model", "data", "sampler", "loss", "optimizer", "adapter", "trainer"]
# The local copy of GSM8K that conf/experiment/gsm8k.yaml documents.
GSM8K_LOCAL = ["data.source=file", "data.subset=null", "data.eval_split=null"]


def plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True)


def test_the_shipped_experiments():
    assert {"arithmetic", "gsm8k"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(compose, experiment):
    cfg = compose([f"experiment={experiment}"])  # no `+`: config.yaml lists `experiment: null`
    if cfg.data.source == "reasoning_gym" and find_spec("reasoning_gym") is None:  # (the oldest leg)
        assert validate(cfg) == [MISSING_PACKAGE]
        return
    assert validate(cfg) == [], f"experiment={experiment} does not validate"


def test_arithmetic_is_the_default_recipe(compose):
    assert plain(compose(["experiment=arithmetic"])) == plain(compose([]))


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_sets_only_what_its_group_choices_do_not(compose, experiment):
    """Every key an experiment sets in a typed group changes what its own group choices give: the
    options stay the one source of what they hold (reward entries are whole specs, see gsm8k)."""
    body = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text()) or {}
    choices = []
    for entry in body.pop("defaults", []):
        if isinstance(entry, dict):
            ((key, option),) = entry.items()
            group = key.removeprefix("override /")
            choices.append(
                f"{group}=[{','.join(option)}]" if isinstance(option, list) else f"{group}={option}"
            )
    without = plain(compose(choices))
    for group in set(body) - {"reward"}:
        assert group in TYPED, f"{experiment}.yaml sets {group}, which is not a config group"
        for key, value in _leaves(body[group]):
            old = OmegaConf.select(OmegaConf.create(without), f"{group}.{key}")
            assert value != old, f"{experiment}.yaml restates {group}.{key}={value!r}"


def test_gsm8k_holds_its_recipe(compose):
    cfg = compose(["experiment=gsm8k"])
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (cfg.data.source, cfg.data.path, cfg.data.subset) == ("hub", "openai/gsm8k", "main")
    assert (cfg.data.eval_split, cfg.data.prompt_column) == ("test", "question")
    assert "The answer is N." in cfg.data.system_prompt
    assert cfg.sampler.max_new_tokens == 512
    assert (cfg.loss.loss_type, cfg.loss.mask_truncated_completions) == ("dapo", True)
    assert cfg.optimizer.learning_rate == 1e-6
    assert cfg.trainer.precision == "auto"
    P, A, G = (
        cfg.trainer.prompts_per_step,
        cfg.trainer.gradient_accumulation_steps,
        cfg.sampler.num_generations,
    )
    assert (P, A, G) == (8, 8, 8)  # one prompt's 8 completions per micro-batch
    assert cfg.trainer.gradient_checkpointing
    assert list(cfg.reward) == ["accuracy", "format"]
    acc, fmt = cfg.reward.accuracy, cfg.reward.format
    assert (acc.extract, acc.strict, acc.answer_column) == ("auto", True, "answer")
    assert (fmt.value, fmt.max_chars, fmt.pattern_mode) == (0.2, None, "search")


@pytest.mark.parametrize("adapter, rate", [("none", 1e-6), ("lora", 2e-4), ("qlora", 2e-4)])
def test_gsm8k_trains_lora_at_the_adapters_learning_rate(compose, adapter, rate):
    """The experiment's 1e-6 is for full fine-tuning: adapter=lora (which sets 2e-4, docs/lora.md)
    still sets its own rate under experiment=gsm8k, and a command-line rate wins over both."""
    assert compose(["experiment=gsm8k", f"adapter={adapter}"]).optimizer.learning_rate == rate
    given = compose(["experiment=gsm8k", f"adapter={adapter}", "optimizer.learning_rate=3e-5"])
    assert given.optimizer.learning_rate == 3e-5


def test_the_command_line_wins_over_an_experiment(compose):
    cfg = compose(
        [
            "experiment=gsm8k",
            "sampler.max_new_tokens=256",
            "data.path=me/gsm8k",
            "optimizer.learning_rate=2e-6",
        ]
    )
    assert (cfg.sampler.max_new_tokens, cfg.data.path, cfg.optimizer.learning_rate) == (256, "me/gsm8k", 2e-6)
    # A group choice too, wherever it stands: loss=grpo replaces the experiment's dapo (all of it).
    for overrides in (["experiment=gsm8k", "loss=grpo", "model=qwen1.5b"], ["loss=grpo", "experiment=gsm8k"]):
        cfg = compose(overrides)
        assert (cfg.loss.loss_type, cfg.loss.epsilon_high, cfg.loss.mask_truncated_completions) == (
            "grpo",
            None,
            False,
        )
        assert validate(cfg) == []
    assert compose(["experiment=gsm8k", "model=qwen1.5b"]).model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"


def test_an_experiments_own_keys_survive_a_group_choice(compose):
    """What gsm8k.yaml documents: its keys are merged after every group, so reward=[accuracy] keeps
    its (complete) format reward; '~reward.format' drops it."""
    kept = compose(["experiment=gsm8k", "reward=[accuracy]"])
    assert list(kept.reward) == ["accuracy", "format"] and kept.reward.format.value == 0.2
    assert validate(kept) == []
    dropped = compose(["experiment=gsm8k", "~reward.format"])
    assert list(dropped.reward) == ["accuracy"]
    assert validate(dropped) == []


def test_gsm8k_on_the_documented_local_copy(compose, tmp_path):
    """The local-copy command line of gsm8k.yaml validates, and reads the file's question column."""
    from grpo_cli.build import read_data
    from grpo_cli.config import to_typed

    path = tmp_path / "gsm8k_train.jsonl"
    rows = [
        {"question": f"Tom has {n} apples and eats 1. How many are left?", "answer": f"#### {n - 1}"}
        for n in range(2, 22)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = compose(["experiment=gsm8k", *GSM8K_LOCAL, f"data.path={path}"])
    assert validate(cfg) == []
    train, held_out = read_data(to_typed(cfg))
    assert len(train) + len(held_out) == 20 and "apples" in train[0]["question"]
    # Without dropping the hub's subset and test split, both are named with their fix.
    problems = validate(compose(["experiment=gsm8k", "data.source=file", f"data.path={path}"]))
    assert len(problems) == 2, problems
    assert "data.subset='main'" in problems[0] and "data.subset=null" in problems[0]
    assert "data.eval_split='test'" in problems[1] and "data.eval_split=null" in problems[1]


# ----------------------------------------------------------------------------- gsm8k's rewards

STEP_BY_STEP = (
    "Natalia sold 48 clips in April.\n"
    "In May she sold half as many: 48 / 2 = 24 clips.\n"
    "Altogether she sold 48 + 24 = 72 clips.\n"
    "The answer is 72."
)


def _format(compose, completions):
    from grpo_cli.rewards.format import format_reward

    options = OmegaConf.to_container(compose(["experiment=gsm8k"]).reward.format)
    options.pop("weight")
    return format_reward(completions, **options)


@pytest.mark.parametrize(
    "completion,paid",
    [
        (STEP_BY_STEP, True),
        (STEP_BY_STEP + "\n\n", True),  # trailing whitespace is stripped
        (STEP_BY_STEP.replace("72.", "1,234."), True),  # thousands separators
        (STEP_BY_STEP.replace("72.", "-3.5."), True),
        (STEP_BY_STEP.rsplit("\n", 1)[0], False),  # reasoning without the final statement
        (
            "Natalia sold 48 clips in April.\nIn May she sold half as many: 48 / 2 =",
            False,
        ),  # cut mid-sentence
        (STEP_BY_STEP.replace("72.", "7"), False),  # cut mid-number: no final period
        (STEP_BY_STEP + "\nLet me double-check: 48 + 24", False),  # the statement is not at the end
        ("The answer is seventy-two.", False),
    ],
    ids=[
        "stated",
        "trailing-space",
        "thousands",
        "decimal",
        "no-statement",
        "truncated",
        "cut-number",
        "not-last",
        "words",
    ],
)
def test_gsm8k_format_reward_pays_the_stated_answer_at_the_end(compose, completion, paid):
    assert _format(compose, [completion]) == [0.2 if paid else 0.0]


def test_gsm8k_accuracy_reads_the_stated_answer(compose):
    from grpo_cli.rewards.accuracy import accuracy

    options = OmegaConf.to_container(compose(["experiment=gsm8k"]).reward.accuracy)
    options.pop("weight")
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    completions = [
        "The answer is 72.",
        STEP_BY_STEP,  # the reasoning's other numbers are operands, not answers: strict passes it
        STEP_BY_STEP.replace("The answer is 72.", "The answer is 71."),
        STEP_BY_STEP + " The answer is 73.",  # two different stated answers: strict gives 0
    ]
    assert accuracy(completions, answer=[gold] * 4, **options) == [1.0, 1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def set_by_options():
    """Every option of every typed group, with the keys it sets (those that differ from the
    default config's): {(group, option): {key: value}}."""
    from conftest import composed

    default = OmegaConf.create(plain(composed([])))
    out = {}
    for group in TYPED:
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            alone = plain(composed([f"{group}={option}"]))
            out[group, option] = {
                f"{group}.{key}": value
                for key, value in _leaves(alone[group])
                if OmegaConf.select(default, f"{group}.{key}") != value
            }
    return out


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_never_replaces_what_a_chosen_group_sets(compose, experiment, set_by_options):
    """`experiment=X group=option`: every key the option sets keeps the option's value, whatever
    the experiment holds. An experiment's own keys are merged after every group, so it may set
    only keys no option sets (the others go in a preset it chooses, as gsm8k's trainer and
    optimizer do); so only options that set one of its own keys are composed with it."""
    body = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text()) or {}
    own = {f"{group}.{key}" for group in set(body) & set(TYPED) for key, _ in _leaves(body[group])}
    for (group, option), keys in set_by_options.items():
        clashes = {key: value for key, value in keys.items() if key in own}
        if not clashes:
            continue
        both = OmegaConf.create(plain(compose([f"experiment={experiment}", f"{group}={option}"])))
        for key, value in clashes.items():
            got = OmegaConf.select(both, key)
            assert got == value, f"experiment={experiment} {group}={option}: {key}={got!r}, not {value!r}"


def test_the_clash_check_finds_an_experiment_key_an_option_sets(set_by_options):
    """The check above can fail: trainer=smoke sets trainer.max_steps, the key gsm8k's trainer
    preset holds (as an experiment key it would have replaced smoke's 5)."""
    assert set_by_options["trainer", "smoke"]["trainer.max_steps"] == 5
    assert "trainer.max_steps" in set_by_options["trainer", "gsm8k"]
