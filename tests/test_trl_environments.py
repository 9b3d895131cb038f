"""TRL's environment classes as they are (environment.style=trl, grpo_cli/environments/trl_class.py):
the class TRL 1.16's GRPOTrainer takes as `environment_factory` (its documented shape: a callable
reset returning None or a string appended to the last user message, public methods as tools,
an optional get_reward) runs unchanged: one instance per episode, reset(**row), its methods
called as tools (typed arguments, bad ones a tool error the model reads), get_reward as the
environment's reward, close() after the episode; a group whose resets differ gets prompts of its
own, and the shared-prompt forward falls back for it with the same log-probs."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_environments import ScriptedSampler, _episodes, _examples

from grpo_cli.config.schema import EnvironmentConfig
from grpo_cli.logprobs import ScoringOptions, score_tokens
from grpo_cli.logprobs.score import groups_share_prompts

CLOSED: list[int] = []


class Counter:
    """A counter the model moves with its tools, in TRL's environment_factory shape."""

    def __init__(self):
        self.count = 0
        self.target = None

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        self.target = int(kwargs["answer"])
        return f" Reach {self.target}."

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return str(self.count)

    def add_pair(self, a: int, b: int) -> str:
        """Add two numbers to the counter.

        Args:
            a: the first
            b: the second
        """
        self.count += a + b
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count == self.target)

    def close(self) -> None:
        CLOSED.append(id(self))


_serial = itertools.count()


class Unique:
    """Each instance's reset says something of its own: a group's prompts differ."""

    def reset(self, **kwargs) -> str:
        return f" Case {next(_serial)}."


class NoReset:
    def increment(self, step: int) -> str:
        return str(step)


class NativeShaped:
    def reset(self, row):
        return None

    def step(self, text):
        return None


def test_a_trl_class_runs_unchanged(tiny_model):
    """One instance per episode, reset(**row) appended to the last user message, the tag protocol
    with a typed argument and a JSON object of two, a bad call answered as a tool error, the
    reward from get_reward and every instance closed."""
    _, tok = tiny_model
    CLOSED.clear()
    # (ScriptedSampler: turn t writes script[t], t the results so far; after the error reply the
    # count stays, so the bad call comes again until max_turns: the episode went on after it.)
    script = [
        "<increment>2</increment>",
        '<add_pair>{"a": 1, "b": 2}</add_pair>',
        '<add_pair>{"a": 1}</add_pair>',  # a missing argument: a tool error the model reads
    ]
    cfg = EnvironmentConfig(fn="test_trl_environments:Counter", style="trl", max_turns=4)
    examples = _examples(tok)  # answers 5 and 3
    r = _episodes(ScriptedSampler(tok, script, "</result>"), tok, cfg, max_new_tokens=40).draw(
        examples, seeds=[0, 1], num_generations=2
    )
    assert len(CLOSED) == 4 and len(set(CLOSED)) == 4  # 2 prompts x G=2, each its own instance
    prompt = tok.decode(r.prompt_ids[0][r.prompt_mask[0].bool()])
    assert "What is 2 plus 3? Reach 5." in prompt and "<increment>" in prompt  # tools listed
    text = tok.decode(r.completion_ids[0][r.attention_mask[0].bool()])
    assert "<result>2</result>" in text and "<result>5</result>" in text
    assert "bad arguments for add_pair" in text
    # The counter reached 5: right for the first prompt (answer 5), wrong for the second (3).
    assert r.env_reward.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_a_group_whose_resets_differ_gets_prompts_of_its_own(tiny_model):
    """Resets that differ within a group: each episode keeps its own prompt, and the shared-prompt
    forward falls back to whole rows for them, with the log-probs of scoring every row alone."""
    model, tok = tiny_model
    cfg = EnvironmentConfig(fn="test_trl_environments:Unique", style="trl", max_turns=1)
    r = _episodes(ScriptedSampler(tok, ["fine</s>"], "%%"), tok, cfg).draw(
        _examples(tok), seeds=[0, 1], num_generations=2
    )
    texts = [tok.decode(r.prompt_ids[n][r.prompt_mask[n].bool()]) for n in range(4)]
    assert len(set(texts)) == 4 and not groups_share_prompts(r.prompt_ids, 2)
    shared = score_tokens(model, *r.inputs(), ScoringOptions(1.0, shared_prompt=True), num_generations=2)
    alone = score_tokens(model, *r.inputs(), ScoringOptions(1.0, shared_prompt=False), num_generations=2)
    assert torch.equal(shared.logps, alone.logps)


@pytest.mark.parametrize(
    "fn, style, expected",
    [
        ("test_trl_environments:NoReset", "trl", "class NoReset has no reset method"),
        ("test_trl_environments:Counter", "native", "set environment.style=trl"),
    ],
)
def test_a_class_of_the_other_style_is_one_paragraph(compose, fn, style, expected):
    from grpo_cli.config import validate

    problems = validate(compose([f"environment.fn={fn}", f"environment.style={style}"]))
    assert len(problems) == 1 and expected in problems[0] and "\n" not in problems[0], problems


def test_the_native_style_still_takes_its_own_shape(compose):
    from grpo_cli.config import validate

    assert validate(compose(["environment.fn=test_trl_environments:NativeShaped"])) == []
    problems = validate(
        compose(["environment.style=trl", "environment.tools=[grpo_cli.environments.calculator:calc]"])
    )
    assert any("environment.style=trl needs environment.fn" in p for p in problems)


@pytest.mark.slow  # an end-to-end run (in this process)
def test_grpo_train_runs_a_trl_class_with_its_reward(tmp_path):
    """End to end on the tiny model: a TRL class from YAML, its get_reward through the
    `environment` reward, logged each step."""
    import json

    from conftest import tiny, train_here

    args = tiny(
        "environment.fn=test_trl_environments:Counter",
        "environment.style=trl",
        "environment.max_turns=2",
        "reward=[accuracy,environment]",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "hydra.run.dir=run",
    )
    train_here(args, tmp_path / "run")  # (what grpo-train trains, in this process; a failure raises)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all("rewards/environment/mean" in r and "env/turns" in r for r in steps)


class Echo:
    """A second TRL class for routing: one tool, no get_reward; its reset must not see the
    routing column (TRL does not pass it on)."""

    def reset(self, **kwargs) -> str:
        assert "environment" not in kwargs, kwargs
        return " Echo it."

    def echo(self, text: str) -> str:
        """Say it back.

        Args:
            text: what to say
        """
        return text


def _routed_examples(tok, names):
    from grpo_cli.data import Example

    out = []
    for q, a, name in zip(("What is 2 plus 3?", "Say hello."), ("5", "hello"), names):
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append(Example(messages, ids, {"answer": a, "environment": name}))
    return out


def test_a_mapping_of_trl_classes_is_chosen_per_row(tiny_model):
    """environment.fn as a mapping (TRL 1.16's dict environment_factory): each row's `environment`
    column picks its class, only that class's tools are listed in its prompt, reset never sees the
    column, and get_reward counts where the class has one (NaN, no score, elsewhere)."""
    from grpo_cli.errors import UserError

    _, tok = tiny_model
    fn = {"counter": "test_trl_environments:Counter", "echo": "test_trl_environments:Echo"}
    cfg = EnvironmentConfig(fn=fn, style="trl", max_turns=2)
    path = _episodes(
        ScriptedSampler(tok, ["<increment>5</increment>", "done</s>"], "</result>"), tok, cfg, 40
    )
    r = path.draw(_routed_examples(tok, ["counter", "echo"]), seeds=[0, 1], num_generations=2)
    prompts = [tok.decode(r.prompt_ids[n][r.prompt_mask[n].bool()]) for n in (0, 2)]
    assert "Reach 5." in prompts[0] and "<increment>" in prompts[0] and "<echo>" not in prompts[0]
    assert "Echo it." in prompts[1] and "<echo>" in prompts[1] and "<increment>" not in prompts[1]
    reward = r.env_reward.tolist()
    assert reward[:2] == [1.0, 1.0] and all(v != v for v in reward[2:])  # echo: no get_reward
    assert r.stat_names == ("turns", "tool_calls", "tool_errors", "replies_cut", "errors", "out_of_turns")
    with pytest.raises(UserError, match=r"environment='chess'.*give every row an `environment` column"):
        path.draw(_routed_examples(tok, ["counter", "chess"]), seeds=[0, 1], num_generations=2)


SEEN: list = []


def sees_environments(prompts, completions, environments, **kwargs):
    """A reward in TRL's form reading the episodes' environment objects (and the prompts the
    resets made): 1 where the counter reached the row's target."""
    SEEN.append((list(prompts), list(environments), list(CLOSED)))
    return [float(env.count == env.target) for env in environments]


def test_rewards_get_the_environments_open_and_the_prompts_the_resets_made(tiny_model):
    """A reward naming `environments` gets each episode's TRL instance, still open (closed once
    the rollout is scored), and `prompts` whose last user message carries the reset's text."""
    from grpo_cli.rewards import build_rewards

    _, tok = tiny_model
    CLOSED.clear()
    SEEN.clear()
    rewards = build_rewards({"mine": {"fn": "test_trl_environments:sees_environments"}})
    assert rewards.take_environments and not build_rewards({"format": {}}).take_environments
    cfg = EnvironmentConfig(fn="test_trl_environments:Counter", style="trl", max_turns=2)
    path = _episodes(
        ScriptedSampler(tok, ["<increment>5</increment>", "done</s>"], "</result>"), tok, cfg, 40
    )
    path.episodes.keep_open = True
    examples = _examples(tok)  # answers 5 and 3
    drawn = path.draw_for_scoring(examples, seeds=[0, 1], num_generations=2)
    assert CLOSED == [] and len(drawn.environments) == 4
    scored = path.score(drawn, examples, rewards, tok)  # (then closes them)
    prompts, envs, closed_then = SEEN[0]
    assert closed_then == [] and all(isinstance(e, Counter) for e in envs) and len(set(map(id, envs))) == 4
    assert prompts[0][-1]["content"].endswith("What is 2 plus 3? Reach 5.")
    assert prompts[3][-1]["content"].endswith("What is 4 minus 1? Reach 3.")
    assert scored.values[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0] and not hasattr(
        scored.rollout, "environments"
    )
    assert sorted(CLOSED) == sorted(map(id, envs))


def test_environments_without_an_environment_is_one_paragraph():
    from grpo_cli.rewards import RewardError, build_rewards
    from grpo_cli.rewards.scoring import score_rewards

    rewards = build_rewards({"mine": {"fn": "test_trl_environments:sees_environments"}})
    with pytest.raises(RewardError, match="takes `environments`.*this run has no environment"):
        score_rewards(list(rewards), ["a"], prompts=["q"], completion_ids=None, columns={})


def test_environments_with_worker_processes_is_refused(compose):
    from grpo_cli.config import validate

    problems = validate(
        compose(["+reward.mine.fn=test_trl_environments:sees_environments", "+reward.mine.workers=2"])
    )
    assert any("takes environments" in p and "cannot reach" in p for p in problems), problems


@pytest.mark.slow  # an end-to-end run (in this process)
def test_grpo_train_routes_rows_to_trl_classes_and_hands_rewards_the_environments(tmp_path):
    """End to end from YAML: environment.fn maps two TRL classes, a JSONL file's `environment`
    column routes each row, and a reward in TRL's form scores from the environment objects."""
    import json

    from conftest import TINY_BASE, train_here

    rows = [
        {"prompt": f"Count to {n}.", "answer": str(n), "environment": "counter" if n % 2 else "echo"}
        for n in range(1, 13)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        *(a for a in TINY_BASE if not a.startswith("data.")),
        "data=jsonl",
        f"data.path={tmp_path / 'rows.jsonl'}",
        "data.eval_size=4",
        "environment.fn={counter: 'test_trl_environments:Counter', echo: 'test_trl_environments:Echo'}",
        "environment.style=trl",
        "environment.max_turns=2",
        "reward=[format]",
        "+reward.reached.fn=test_trl_environments:reached",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "hydra.run.dir=run",
    ]
    train_here(args, tmp_path / "run")  # (what grpo-train trains, in this process; a failure raises)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert len(steps) == 2 and all("rewards/reached/mean" in r and "env/turns" in r for r in steps)


def reached(completions, environments, **kwargs):
    """1 where a Counter reached its target; None (not applicable) for the other classes."""
    return [float(env.count == env.target) if isinstance(env, Counter) else None for env in environments]


DOC_RUNS = {
    # TRL's self-sampling IncrementEnv: the environment owns the task (rows without a prompt).
    "self-sampling": (
        [{"n": i} for i in range(12)],
        ["environment.fn=trl_doc_environments:IncrementEnv", "reward=[environment]"],
    ),
    # The same with an external dataset: the row's `target` reaches reset(target=...).
    "external-dataset": (
        [
            {"prompt": [{"role": "user", "content": f"Increment the counter to {i}."}], "target": i}
            for i in range(1, 13)
        ],
        ["environment.fn=trl_doc_environments:IncrementEnvFromData", "reward=[environment]"],
    ),
    # Multiple environments, routed by the `environment` column alone (no prompt column).
    "multiple": (
        [{"environment": name} for name in ["coding", "game"] * 6],
        [
            "environment.fn={coding: 'trl_doc_environments:CodingEnv', game: 'trl_doc_environments:GameEnv'}",
            "reward=[]",
            "+reward.env.fn=trl_doc_environments:reward_func",
        ],
    ),
}


@pytest.mark.slow  # an end-to-end run (in this process)
@pytest.mark.parametrize("example", list(DOC_RUNS))
def test_trls_documented_environment_examples_run_unchanged(tmp_path, example):
    """The classes of TRL's GRPO guide (tests/trl_doc_environments.py, cited there), unchanged, in
    a two-step grpo-train on the tiny model: each run trains and logs the episodes' metrics."""
    import json

    from conftest import TINY_BASE, train_here

    rows, overrides = DOC_RUNS[example]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        *(a for a in TINY_BASE if not a.startswith("data.")),
        "data=jsonl",
        f"data.path={tmp_path / 'rows.jsonl'}",
        "data.eval_size=2",
        "environment.style=trl",
        "environment.max_turns=2",
        *overrides,
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "hydra.run.dir=run",
    ]
    train_here(args, tmp_path / "run")  # (what grpo-train trains, in this process; a failure raises)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert len(steps) == 2 and all("env/turns" in r and "env/tool_call_rate" in r for r in steps)


# ----------------------------------------------------------------------------- failures


class ResetRaises:
    def reset(self, **kwargs):
        raise RuntimeError("no task today")

    def increment(self, step: int) -> str:
        """Add.

        Args:
            step: how much
        """
        return str(step)


class ResetHangs(ResetRaises):
    def reset(self, **kwargs):
        import time

        time.sleep(5)


class ToolRaises:
    def reset(self, **kwargs):
        return None

    def increment(self, step: int) -> str:
        """Add.

        Args:
            step: how much
        """
        raise ValueError("the counter is stuck")


@pytest.mark.parametrize(
    "fn, message",
    [
        ("ResetRaises", r"reset\(row\) raised RuntimeError: no task today \(episode 0 of the prompt"),
        ("ResetHangs", r"reset\(row\) raised TimeoutError"),
    ],
)
def test_a_failing_trl_class_is_one_paragraph_or_masked_episodes(tiny_model, fn, message):
    """reset raising or hanging (environment.timeout_s): on_error=raise stops with one paragraph
    naming the class, the call and the episode; on_error=mask leaves those episodes out of the loss
    (counted, env/errors) and the rollout keeps every row."""
    from dataclasses import replace

    from grpo_cli.environments.episodes import episode_metrics
    from grpo_cli.errors import UserError

    _, tok = tiny_model
    cfg = EnvironmentConfig(fn=f"test_trl_environments:{fn}", style="trl", max_turns=2, timeout_s=0.5)
    sampler = ScriptedSampler(tok, ["<increment>2</increment>", "done</s>"], "</result>")
    with pytest.raises(UserError, match=rf"environment test_trl_environments:{fn}: {message}.*on_error=mask"):
        _episodes(sampler, tok, cfg, 40).draw(_examples(tok), seeds=[0, 1], num_generations=2)
    r = _episodes(sampler, tok, replace(cfg, on_error="mask"), 40).draw(
        _examples(tok), seeds=[0, 1], num_generations=2
    )
    assert r.completion_ids.shape[0] == 4 and int(r.trained_mask.sum()) == 0
    assert episode_metrics(r)["env/errors"] == 1.0


def test_a_trl_tool_that_raises_is_a_tool_error_the_model_reads(tiny_model):
    """A tool's exception is the model's to read (a tool error, counted), never the run's."""
    from grpo_cli.environments.episodes import episode_metrics

    _, tok = tiny_model
    cfg = EnvironmentConfig(fn="test_trl_environments:ToolRaises", style="trl", max_turns=2)
    sampler = ScriptedSampler(tok, ["<increment>2</increment>", "done</s>"], "</result>")
    r = _episodes(sampler, tok, cfg, 40).draw(_examples(tok), seeds=[0, 1], num_generations=2)
    text = tok.decode(r.completion_ids[0][r.attention_mask[0].bool()])
    assert "<error>the counter is stuck</error>" in text
    m = episode_metrics(r)
    assert m["env/tool_errors"] >= 1.0 and m["env/errors"] == 0.0 and int(r.trained_mask.sum()) > 0
