"""reasoning-gym as a data source (data=reasoning_gym) and its scorer as the correctness reward
(reward=[reasoning_gym]): the rows, their determinism and held-out split, the mixing weights, the
errors config validation gives, and one tiny training run."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict

import pytest
from conftest import tiny, train_here
from omegaconf import OmegaConf

pytest.importorskip(
    "reasoning_gym",
    reason="reasoning-gym is not installed (pip install -e '.[reasoning-gym]' in grpo-cli's folder)",
)

from grpo_cli.build import read_data  # noqa: E402
from grpo_cli.config import to_typed, validate  # noqa: E402
from grpo_cli.data import reasoning_gym as rg_data  # noqa: E402
from grpo_cli.data.reasoning_gym import DEFAULT_TASKS, MISSING_PACKAGE, TaskSpec, task_rows  # noqa: E402
from grpo_cli.errors import UserError  # noqa: E402
from grpo_cli.rewards.reasoning_gym import extract_answer, reasoning_gym_reward  # noqa: E402

PRESET = ["data=reasoning_gym", "reward=[reasoning_gym]"]


def rows_of(*specs: TaskSpec, size: int = 20, eval_size: int = 10, seed: int = 0, eval_seed: int = 99):
    return task_rows(
        list(specs), size, eval_size, seed=seed, eval_seed=eval_seed, instruction=rg_data.INSTRUCTION
    )


def one_row(task: str, seed: int = 0) -> dict:
    return rows_of(TaskSpec(task), size=1, eval_size=0, seed=seed)[0][0]


def score(row: dict, completion: str) -> float | None:
    columns = {k: [row[k]] for k in ("task", "answer", "metadata", "question")}
    return reasoning_gym_reward([completion], **columns)[0]


# ----------------------------------------------------------------------------- the reward


def _table():
    """(task, completion given the gold answer, expected score given the gold answer)."""
    return [
        ("chain_sum", lambda g: f"4 + 5 = 9, so\nAnswer: {g}", lambda g: 1.0),
        ("chain_sum", lambda g: f"answer: **{g}**.", lambda g: 1.0),  # case, bold, full stop
        ("chain_sum", lambda g: f"Answer: {int(g) + 1}", lambda g: 0.0),
        ("chain_sum", lambda g: "No marker at all, the last line counts\nzzz", lambda g: 0.0),
        ("chain_sum", lambda g: f"Answer: {g} apples", lambda g: len(g) / len(f"{g} apples")),  # part marks
        ("chain_sum", lambda g: "", lambda g: 0.0),
        ("spell_backward", lambda g: f"Answer: {g}", lambda g: 1.0),
        ("spell_backward", lambda g: f"Answer:\n{g}", lambda g: 1.0),  # the next line
        ("spell_backward", lambda g: f"Answer: {g[:-1]}#", lambda g: (len(g) - 1) / len(g)),  # part marks
        ("number_sorting", lambda g: f"Sorted.\nAnswer: {g}", lambda g: 1.0),
        (
            "number_sorting",
            lambda g: f"Answer: {json.dumps(json.loads(g.replace(chr(39), chr(34)))[::-1])}",
            lambda g: 0.0,
        ),
    ]


@pytest.mark.parametrize("task, completion, expected", _table())
def test_the_reward_is_the_tasks_own_score_of_the_stated_answer(task, completion, expected):
    row = one_row(task)
    gold = row["answer"]
    assert score(row, completion(gold)) == pytest.approx(expected(gold))


def test_a_row_without_a_task_is_not_applicable_and_chat_completions_are_read():
    row = one_row("chain_sum")
    chat = [{"role": "assistant", "content": f"Answer: {row['answer']}"}]
    out = reasoning_gym_reward(
        [chat, "Answer: 1"],
        task=[row["task"], None],
        answer=[row["answer"], "1"],
        metadata=[row["metadata"], {}],
    )
    assert out == [1.0, None]


def test_extraction_takes_the_last_marker_and_falls_back_to_the_last_line():
    assert extract_answer("Answer: 3\nwait, no.\nAnswer: 4") == "4"
    assert extract_answer("thinking\n\n 12 \n") == "12"
    assert extract_answer("Answer: end.", gold="end.") == "end."
    assert extract_answer("   ") is None
    # No marker, a numeric gold: the last number of the last line (what a small model writes).
    assert extract_answer("1 + 5 = 6", gold="6") == "6"
    assert extract_answer("The answer to this problem is 15.", gold="6") == "15"
    assert extract_answer("Answer: 1 + 5 = 6", gold="6") == "1 + 5 = 6"  # a marker: its text as stated
    assert extract_answer("1 + 5 = 6", gold="olleh") == "1 + 5 = 6"  # a word's gold: the line


# ----------------------------------------------------------------------------- the rows


def test_rows_are_the_same_for_the_same_seed_and_differ_for_another():
    spec = [TaskSpec("chain_sum"), TaskSpec("leg_counting", 2.0, {"max_animals": 4})]
    first, again, other = rows_of(*spec), rows_of(*spec), rows_of(*spec, seed=1)
    assert first == again  # materialised from the seed: a resumed stream sees the same rows
    assert first[0] != other[0]
    row = first[0][0]
    assert set(row) == {"prompt", "answer", "question", "task", "metadata"}
    assert row["prompt"].startswith(row["question"]) and row["prompt"].endswith(rg_data.INSTRUCTION)
    assert json.loads(json.dumps(first)) == [list(first[0]), list(first[1])]  # JSON-safe, tuples as lists


def test_held_out_rows_never_repeat_a_training_question():
    # A small space (one-digit sums of two terms): many held-out draws are training questions.
    small = TaskSpec("chain_sum", 1.0, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    train, held = rows_of(small, size=150, eval_size=40, eval_seed=0)  # eval_seed = seed: the same draws
    assert len(held) == 40
    assert not {r["question"] for r in held} & {r["question"] for r in train}
    assert len({r["question"] for r in held}) == 40
    with pytest.raises(UserError, match="too few distinct questions"):
        rows_of(
            TaskSpec("chain_sum", 1.0, {"min_terms": 2, "max_terms": 2, "max_digits": 1}),
            size=500,
            eval_size=400,
        )


def test_weights_set_the_mixture():
    train, _ = rows_of(TaskSpec("chain_sum", 3.0), TaskSpec("leg_counting", 1.0), size=400, eval_size=0)
    counts = Counter(r["task"] for r in train)
    assert 260 <= counts["chain_sum"] <= 340 and counts["chain_sum"] + counts["leg_counting"] == 400


# ----------------------------------------------------------------------------- config


def test_the_preset_composes_and_reads(compose):
    cfg = compose(PRESET + ["data.options.size=30", "data.eval_size=10"])
    assert validate(cfg) == []
    # The preset lists every option (settable without a +) at Options' defaults.
    assert OmegaConf.to_container(compose(PRESET).data.options) == asdict(rg_data.Options())
    typed = to_typed(cfg)
    train, held = read_data(typed)
    assert (len(train), len(held)) == (30, 10)
    assert {r["task"] for r in train} <= set(DEFAULT_TASKS)
    assert typed.data.eval_group_by == "task" and typed.reward["reasoning_gym"].marker == "Answer:"
    # The run's seed draws the rows unless data.options.seed is set.
    assert read_data(to_typed(compose(PRESET + ["data.options.size=30", "trainer.seed=1"])))[0] != train


@pytest.mark.parametrize(
    "tasks, expected",
    [
        ("[chain_summ]", "'chain_summ' is not a reasoning-gym task. Did you mean chain_sum"),
        ("[{name:chain_sum,weight:0}]", "data.options.tasks[0].weight=0 (chain_sum) must be > 0"),
        ("[{name:chain_sum,weight:-1}]", "weight=-1 (chain_sum) must be > 0"),
        ("[{name:leg_counting,config:{max_animals:99}}]", "leg_counting rejects config {'max_animals': 99}"),
        (
            "[{name:chain_sum,config:{terms:3}}]",
            "chain_sum's config has terms, which chain_sum does not read",
        ),
        ("[{name:chain_sum,config:{seed:3}}]", "set data.options.seed instead"),
        ("[chain_sum,chain_sum]", "lists chain_sum more than once"),
    ],
)
def test_a_bad_task_is_one_paragraph_from_config_validation(compose, tasks, expected):
    problems = validate(compose(PRESET + [f"data.options.tasks={tasks}"]))
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert expected in problems[0]


def test_without_the_package_validation_says_how_to_install_it(compose, monkeypatch):
    cfg = compose(PRESET)
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # import fails
    assert validate(cfg) == [MISSING_PACKAGE]


# ----------------------------------------------------------------------------- a run


@pytest.mark.slow  # an end-to-end run (in this process)
def test_a_tiny_run_logs_the_reward_and_accuracy_per_task(tmp_path):
    args = tiny(
        *PRESET,
        "hydra.run.dir=run",
        "data.options.tasks=[chain_sum,basic_arithmetic]",
        "data.options.size=16",
        "data.eval_size=6",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "trainer.save_steps=2",
    )
    args = [a for a in args if not a.startswith("data.num_examples")]
    train_here(args, tmp_path / "run")  # (what grpo-train trains, in this process; a failure raises)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/reasoning_gym/mean" in r for r in rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(
        f"eval/accuracy/{task}" in r for r in evals for task in ("chain_sum", "basic_arithmetic")
    )
