"""Rewards in TRL's form run unchanged (issue #48): a function that names `completions` is called
all by keyword, as TRL 1.16's GRPOTrainer calls it (prompts, completions, completion_ids, the
dataset's columns, trainer_state, log_metric); any other keeps grpo-cli's fn(completions, **kw)."""

import pytest

from grpo_cli.rewards import RewardError, build_rewards, score_rewards
from grpo_cli.rewards._calling import by_keyword
from grpo_cli.rewards.scoring import Logs, TrainerProgress


def _score(rewards: dict, completions, **kw):
    specs = build_rewards(rewards)
    kw.setdefault("prompts", ["p"] * len(completions))
    kw.setdefault("completion_ids", None)
    kw.setdefault("columns", {})
    return score_rewards(specs, completions, **kw)


@pytest.mark.parametrize(
    "fn, expected",
    [
        (lambda completions, **kw: None, True),
        (lambda prompts, completions, **kw: None, True),
        (lambda completions, solution, **kw: None, True),
        (lambda *completions, **kw: None, False),  # (not a parameter of that name)
        (lambda texts, **kw: None, False),  # grpo-cli's positional call
    ],
)
def test_which_rewards_are_called_by_keyword(fn, expected):
    assert by_keyword(fn) is expected


def test_a_reward_whose_first_parameter_is_prompts_gets_the_prompts():
    # The defect: called positionally, this raised "got multiple values for argument 'prompts'".
    _, per = _score({"mine": {"fn": "trl_style_rewards:prompt_first"}}, ["ab", "abcdef"], prompts=["abc"] * 2)
    assert per["mine"] == [0.0, 1.0]


def test_a_reward_reading_a_column_by_name():
    _, per = _score(
        {"mine": {"fn": "trl_style_rewards:from_solution"}}, ["x=4", "x=5"], columns={"solution": ["4", "4"]}
    )
    assert per["mine"] == [1.0, 0.0]


def test_trainer_state_carries_the_step_and_max_steps():
    spec = {"mine": {"fn": "trl_style_rewards:by_progress"}}
    _, per = _score(spec, ["a", "b"], progress=TrainerProgress(global_step=3, max_steps=12))
    assert per["mine"] == [0.25, 0.25]
    _, before = _score(spec, ["a"])  # no progress given (grpo-eval): step 0
    assert before["mine"] == [0.0]


def test_log_metric_values_are_collected():
    logs = Logs()
    _score({"mine": {"fn": "trl_style_rewards:logs_a_metric"}}, ["ab", "abcd"], logs=logs)
    _score({"mine": {"fn": "trl_style_rewards:logs_a_metric"}}, ["abcdef"], logs=logs)
    assert logs.metrics == {"mean_chars": [3.0, 6.0]}


def test_none_means_not_applicable_and_the_other_rewards_count():
    rewards = {
        "mine": {"fn": "trl_style_rewards:not_applicable_without_solution"},
        "other": {"fn": "trl_style_rewards:from_solution", "weight": 0.5},
    }
    totals, per = _score(rewards, ["4", "4"], columns={"solution": ["4", ""]})
    assert per["mine"] == [1.0, None]
    assert totals == [1.5, 0.5]  # a None adds nothing to its row's total (TRL's nansum)


def test_a_positional_reward_keeps_grpo_clis_call():
    def texts_first(texts, **kwargs):  # no parameter named completions
        return [float(len(t)) for t in texts]

    _, per = _score({"mine": {"fn": texts_first}}, ["ab", "abc"])
    assert per["mine"] == [2.0, 3.0]


def test_log_extra_columns_are_collected_one_value_per_completion():
    """TRL's log_extra(column, values): a column of the logged completions; a list of the wrong
    length is one paragraph naming the reward."""
    logs = Logs()
    _score({"mine": {"fn": "trl_style_rewards:needs_log_extra"}}, ["ab", "abcd"], logs=logs)
    assert logs.extra == {"chars": [2, 4]}
    with pytest.raises(RewardError, match="log_extra\\('chars', ...\\) with 1 values for the 2 completions"):
        _score({"mine": {"fn": "trl_style_rewards:bad_log_extra"}}, ["ab", "abcd"], logs=Logs())


@pytest.mark.parametrize("fn, name", [("logs_a_metric", "log_metric"), ("needs_log_extra", "log_extra")])
def test_trl_logging_cannot_reach_worker_processes(fn, name):
    with pytest.raises(RewardError, match=f"{name}.*cannot reach worker processes"):
        build_rewards({"mine": {"fn": f"trl_style_rewards:{fn}", "workers": 2}})


def test_worker_processes_call_a_trl_reward_by_keyword():
    rewards = {"mine": {"fn": "trl_style_rewards:prompt_first", "workers": 1}}
    specs = build_rewards(rewards).open()
    try:
        _, per = score_rewards(specs, ["ab", "abcdef"], prompts=["abc"] * 2, completion_ids=None, columns={})
    finally:
        specs.close()
    assert per["mine"] == [0.0, 1.0]


def test_trl_own_reward_functions_run_unchanged():
    pytest.importorskip(
        "trl.rewards", reason="TRL is not installed (pip install -e '.[trl]' in grpo-cli's folder)"
    )
    texts = ("<think>\nhm\n</think>\nThe answer is \\boxed{4}", "\\boxed{4}")
    chat = [[{"role": "assistant", "content": c}] for c in texts]
    _, per = _score(
        {
            "think": {"fn": "trl.rewards:think_format_reward"},
            "acc": {"fn": "trl.rewards:accuracy_reward"},
        },
        chat,
        prompts=[[{"role": "user", "content": "2+2?"}]] * 2,
        columns={"solution": ["$4$", "$5$"]},
    )
    assert per["think"] == [1.0, 0.0]
    assert per["acc"] == [1.0, 0.0]


@pytest.mark.slow
def test_a_run_logs_a_trl_rewards_metric_and_its_progress(compose, tmp_path):
    """A tiny-model run of two steps: the TRL-form rewards run, log_metric's value is in the step's
    metrics.jsonl row, log_extra's column in every logged completion, and trainer_state's step
    advances (0, then 1)."""
    import json

    from grpo_cli.cli.train import train_config

    cfg = compose(
        [
            "model=tiny",
            "reward=[accuracy]",
            "+reward.logs.fn=trl_style_rewards:logs_a_metric",
            "+reward.progress.fn=trl_style_rewards:by_progress",
            "+reward.extra.fn=trl_style_rewards:needs_log_extra",
            "sampler.num_generations=2",
            "sampler.max_new_tokens=4",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "trainer.quiet=true",
        ]
    )
    (tmp_path / "run").mkdir()
    train_config(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mean_chars" in r]
    assert len(rows) == 2 and all(r["mean_chars"] >= 0 for r in rows)
    assert [r["rewards/progress/mean"] for r in rows] == [0.0, 0.5]
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert records and all(r["extra"]["chars"] == len(r["completion"]) for r in records)
