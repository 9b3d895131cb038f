"""grpo_cli.train (grpo_cli/api.py): a run from Python with a callable reward and rows in memory,
grpo-train's validation, run folder and resume; tested in-process on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny
from omegaconf import OmegaConf

import grpo_cli
from grpo_cli.errors import UserError

ROWS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(8) for b in range(5)]
HELD_OUT = [{"prompt": f"What is {a} plus 9?", "answer": str(a + 9)} for a in range(6)]
CALLS: list[int] = []


def small(*overrides: str) -> list[str]:
    """The tiny model's overrides, less the arithmetic generator's size (rows are given here)."""
    return [o for o in tiny(*overrides) if not o.startswith("data.num_examples=")]


def brevity(completions, answer, **kwargs):
    """A TRL-style reward (keyword arguments, a dataset column among them)."""
    CALLS.append(len(completions))
    assert len(answer) == len(completions)
    return [-float(len(c)) for c in completions]  # (shorter is better; it varies within a group)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("api") / "run"
    CALLS.clear()
    overrides = small(
        "trainer.max_steps=2", "trainer.save_steps=2", "trainer.eval_steps=2", "data.eval_size=4"
    )
    return run_dir, grpo_cli.train(
        overrides, rewards={"brevity": brevity}, train_rows=ROWS, eval_rows=HELD_OUT, run_dir=run_dir
    )


def test_a_run_from_python_trains_with_a_callable_and_rows(api_run):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models import build_tiny

    run_dir, result = api_run
    assert result.run_dir == run_dir and result.checkpoint == run_dir / "checkpoints" / "step-000002"
    assert result.metrics["step"] == 2 and "rewards/brevity/mean" in result.metrics
    assert sum(CALLS) >= 2 * 4 * 4  # every completion of both steps scored by the callable
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert list(saved.reward) == ["brevity"]  # the callables alone, as TRL's reward_funcs
    assert saved.reward.brevity.fn == "grpo_cli.api:given_rewards.brevity"
    assert saved.data.source == "rows"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(
        r.get("eval/num_prompts", r.get("eval/reward")) is not None for r in rows if "eval/reward" in r
    )
    trained = AutoModelForCausalLM.from_pretrained(result.checkpoint)
    initial = AutoModelForCausalLM.from_pretrained(build_tiny())
    assert not torch.equal(_flat(trained), _flat(initial)), "parameters did not change"


def test_a_run_from_python_resumes_as_the_command_line(api_run):
    run_dir, first = api_run
    more = small("trainer.max_steps=3", "trainer.save_steps=3", "data.eval_size=4", "trainer.resume=auto")
    result = grpo_cli.train(
        more, rewards={"brevity": brevity}, train_rows=ROWS, eval_rows=HELD_OUT, run_dir=run_dir
    )
    assert result.metrics["step"] == 3 and result.checkpoint.name == "step-000003"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rewards": {"accuracy": brevity}}, "built-in reward's name"),
        ({"rewards": {"mine": 3}}, "not a function"),
        ({"train_rows": []}, "train_rows is empty"),
        ({"train_rows": 5}, "must be a list of dicts"),
        ({"eval_rows": HELD_OUT}, "without train_rows"),
        ({"train_rows": ROWS, "overrides": ["loss.beta=-1", "sampler.num_generations=1"]}, "loss.beta"),
        ({"train_rows": ROWS, "overrides": ["trainer.num_processes=2"]}, "one\nprocess"),
        (
            {"rewards": {"mine": brevity}, "overrides": ["model=tiny", "+reward.mine.workers=2"]},
            "runs in this process",
        ),
    ],
)
def test_bad_input_is_one_user_error_before_any_model_loads(tmp_path, kwargs, message):
    from grpo_cli.api import given_rewards
    from grpo_cli.data.rows import given

    overrides = kwargs.pop("overrides", ["model=tiny"])
    with pytest.raises(UserError) as err:
        grpo_cli.train(overrides, run_dir=tmp_path / "run", **kwargs)
    assert message.replace("\n", " ") in str(err.value)
    assert not (tmp_path / "run").exists()
    assert not vars(given_rewards) and given.train is None and given.eval is None  # nothing left behind
    mine = tmp_path / "mine"  # a folder of the caller's, empty, is not removed with the failed run
    mine.mkdir()
    with pytest.raises(UserError):
        grpo_cli.train(overrides, run_dir=mine, **kwargs)
    assert mine.is_dir()


def test_rows_source_needs_rows_on_the_command_line(compose):
    from grpo_cli.config import validate

    problems = validate(compose(["data=rows"]))
    assert any("grpo_cli.train(train_rows=...)" in p for p in problems)
