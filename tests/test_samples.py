"""Logged completions (grpo_cli/samples.py): the records, the console's samples table,
completions.jsonl on resume, grpo-report --samples, and TRL-style chat rewards."""

from __future__ import annotations

import json

import pytest
from conftest import TESTS, console_script, run_cli
from rich.console import Console

from grpo_cli.cli.report import main as report_main
from grpo_cli.cli.train import train_config as run
from grpo_cli.metrics import MetricsLogger
from grpo_cli.rewards import as_reward_input, build_rewards, score_rewards
from grpo_cli.samples import (
    SAMPLES_FILE,
    Completions,
    read_records,
    shorten,
    showcase,
    showcase_table,
    step_records,
)


def records(step=1, rewards=(1.2, 0.0, 0.2, 0.2, 0.2, 0.2), G=3, text="x"):
    n = len(rewards)
    completions = Completions(
        prompts=[f"p{i // G}" for i in range(n)],
        texts=[f"{text}{i}" for i in range(n)],
        reward_values={"accuracy": [float(r >= 1) for r in rewards], "format": [0.2] * n},
        totals=list(rewards),
        advantages=[0.0] * n,
        lengths=[3] * n,
        truncated=[i == 1 for i in range(n)],
        zero_std=[i >= G for i in range(n)],
    )
    return step_records(step, completions, G)


@pytest.mark.parametrize(
    "text,limit,expected",
    [
        ("47", 40, "47"),
        ("a\nb", 40, "a⏎b"),
        ("x" * 50, 10, "x" * 9 + "…"),
        ([{"role": "user", "content": "What is 2 plus 2?"}], 40, "What is 2 plus 2?"),
    ],
)
def test_shorten_keeps_one_line(text, limit, expected):
    assert shorten(text, limit) == expected


def test_showcase_picks_the_group_with_most_spread_and_its_extremes():
    row = showcase(records())
    assert row["prompt"] == "p0" and row["best"]["reward"] == 1.2 and row["worst"]["reward"] == 0.0
    assert row["worst"]["truncated"]  # (shown as "(cut)")
    console = Console(width=120, record=True)
    console.print(showcase_table([row]))
    out = console.export_text()
    assert "'x0'" in out and "'x1' (cut)" in out and "1.2" in out
    assert showcase([]) is None


def test_completions_file_is_cut_back_on_resume_and_restarted_by_a_new_run(tmp_path):
    with MetricsLogger(tmp_path, total_steps=3, quiet=True) as log:
        for step in (1, 2, 3):
            log.log_samples(records(step, text="long text\nwith a newline " * 20), show=True)
    assert [r["step"] for r in read_records(tmp_path)] == [1] * 6 + [2] * 6 + [3] * 6
    assert read_records(tmp_path)[0]["completion"].startswith("long text\nwith a newline long")  # whole
    with MetricsLogger(tmp_path, total_steps=3, quiet=True, resume_step=2):
        pass
    assert [r["step"] for r in read_records(tmp_path)] == [1] * 6 + [2] * 6
    with MetricsLogger(tmp_path, total_steps=3, quiet=True):
        pass
    assert not (tmp_path / SAMPLES_FILE).exists()


def test_grpo_report_prints_a_steps_samples(tmp_path, capsys):
    lines = [json.dumps(r) for step in (1, 2) for r in records(step, text=f"s{step}-")]
    (tmp_path / SAMPLES_FILE).write_text("\n".join(lines) + "\n" + '{"step": 3, "cut sho')  # still writing
    with pytest.raises(SystemExit) as exit_:
        report_main([str(tmp_path), "--samples", "last"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "step 2, group 0: p0" in out and "step 2, group 1: p1" in out
    assert "s2-0" in out and "s1-0" not in out and "zero-std" in out and "cut" in out
    for arg, words in (("9", "logged steps 1-2"), ("x", "step number or 'last'")):
        with pytest.raises(SystemExit) as exit_:
            report_main([str(tmp_path), "--samples", arg])
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_:
        report_main([str(empty), "--samples", "1"])
    assert exit_.value.code == 2 and "trainer.log_completions" in capsys.readouterr().err


# ----------------------------------------------------------------------------- TRL-style rewards


def test_trl_style_rewards_get_chat_completions_for_chat_prompts():
    import trl_style_rewards as trl

    specs = build_rewards(
        {
            "fmt": {"fn": "trl_style_rewards:format_reward_func"},
            "ans": {"fn": "trl_style_rewards:reward_contains_answer"},
            "accuracy": {"extract": "answer_tag"},  # the built-in accuracy reads both forms
        }
    )
    chat_prompt = [{"role": "user", "content": "What is 2 plus 2?"}]
    texts = ["<think>two and two</think><answer>4</answer>", "5"]
    completions = [as_reward_input(chat_prompt, t) for t in texts]
    assert completions[0] == [{"role": "assistant", "content": texts[0]}]
    totals, per = score_rewards(
        specs,
        completions,
        prompts=[chat_prompt] * 2,
        completion_ids=None,
        columns={"answer": ["4", "4"]},
    )
    assert per == {"fmt": [1.0, 0.0], "ans": [1.0, 0.0], "accuracy": [1.0, 0.0]}
    assert totals == [3.0, 0.0]
    # A plain-text prompt keeps plain-text completions (TRL's standard format).
    assert as_reward_input("What is 2 plus 2?", "4") == "4"
    assert trl.reward_len(["x" * 18]) == [-2]


def test_a_run_on_chat_prompts_runs_a_trl_reward_unchanged(compose, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}], "answer": str(i + 1)}
            )
            + "\n"
            for i in range(24)
        )
    )
    cfg = compose(
        [
            "model=tiny",
            "data=jsonl",
            f"data.path={data}",
            "data.eval_size=4",
            "reward=[length]",  # a built-in reward reads chat completions too
            "reward.length.unit=chars",
            "+reward.trl.fn=trl_style_rewards:reward_contains_answer",
            "sampler.num_generations=4",
            "sampler.max_new_tokens=4",
            "trainer.max_steps=1",
            "trainer.prompts_per_step=2",
            "trainer.quiet=true",
        ]
    )
    (tmp_path / "run").mkdir()
    row = run(cfg, tmp_path / "run")
    assert "rewards/trl/mean" in row and "rewards/length/mean" in row
    logged = read_records(tmp_path / "run")
    assert logged and isinstance(logged[0]["prompt"], list) and isinstance(logged[0]["completion"], str)


def test_grpo_reward_test_chat_flag_runs_a_trl_reward(tmp_path):
    script, env = console_script("grpo-reward-test"), {"PYTHONPATH": str(TESTS)}
    args = ["reward=[]", "+reward.fmt.fn=trl_style_rewards:format_reward_func"]
    ok = run_cli(
        [script, *args, "--chat", "-c", "<think>a</think><answer>b</answer>", "-c", "b"], tmp_path, env=env
    )
    assert ok.returncode == 0, ok.stderr
    rows = [line.split("│") for line in ok.stdout.splitlines() if line.startswith("│ ")]
    assert [(r[1].strip(), r[3].strip()) for r in rows] == [("0", "1"), ("1", "0")], ok.stdout
    # Without --chat the same reward gets strings, which it was not written for: a named error.
    plain = run_cli([script, *args, "-c", "b"], tmp_path, env=env)
    assert plain.returncode == 2 and "reward 'fmt' raised TypeError" in plain.stderr, plain.stderr
    assert "chat messages" in plain.stderr  # the hint: TRL's conversational format, and when it applies


@pytest.mark.parametrize("width", [80, 120])
def test_the_samples_table_keeps_every_column_on_one_line(width):
    """Long texts are cut to fit the console, so no column is dropped or wrapped."""
    rows = [
        showcase(records(step, text="a long rambling completion that goes on\nand on " * 5))
        for step in (8, 9)
    ]
    console = Console(width=width, record=True)
    console.print(showcase_table(rows, width=width))
    lines = console.export_text().splitlines()
    body = [line for line in lines if line.strip()[:1].isdigit()]
    assert [line.split()[0] for line in body] == ["8", "9"], lines
    assert all(line.rstrip().endswith("0") and "1.2" in line and "…" in line for line in body), lines
    assert all(len(line.rstrip()) <= width for line in lines)
    assert "step" in lines[1] and lines[1].count(" r") == 2, lines
