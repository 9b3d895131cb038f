"""skyrl-gym's text environments as they are (environment.style=text_gym,
grpo_cli/environments/text_gym.py): a registered id (skyrl's gsm8k grades the final `#### N`
against the row's answer) or a BaseTextEnv subclass by import path; init's messages are the
prompt, observations the replies, per-turn rewards summed or the last kept, close() per episode;
a postprocessed_action that is a strict prefix cuts the turn's sampled tokens there (token-exact),
one that is not is counted (env/action_not_cut); a bad id and a missing package are one paragraph
at validation; grpo-train runs gsm8k end to end."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from test_environments import ScriptedSampler, _episodes, _examples

pytest.importorskip("skyrl_gym", reason="environment.style=text_gym needs skyrl-gym (the skyrl-gym extra)")

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402

from grpo_cli.config.schema import EnvironmentConfig  # noqa: E402
from grpo_cli.environments.episodes import episode_metrics  # noqa: E402
from grpo_cli.environments.rendering import Rendering  # noqa: E402

CLOSED: list[int] = []
SEEN: list[str] = []


class TwoTurns(BaseTextEnv):
    """Two turns: 0.5 for the first (and a user message: "again"), 1.0 for the second."""

    def __init__(self, env_config=None, extras={}):  # noqa: B006 - skyrl-gym's own signature
        super().__init__()
        self.ground_truth = extras["reward_spec"]["ground_truth"]

    def init(self, prompt):
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + " Twice."}], {}

    def step(self, action):
        self.turns += 1
        SEEN.append(action)
        if self.turns == 1:
            return BaseTextEnvStepOutput(
                observations=[{"role": "user", "content": "again"}], reward=0.5, done=False, metadata={}
            )
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})

    def close(self):
        CLOSED.append(id(self))


class Cutting(BaseTextEnv):
    """Cuts the action after its first "STOP" (skyrl's stop-string cut), then the episode ends."""

    def __init__(self, env_config=None, extras={}):  # noqa: B006
        super().__init__()
        self.config = env_config

    def step(self, action):
        SEEN.append(action)
        keep = action[: action.index("STOP") + 4] if "STOP" in action else self.config.get("keep")
        return BaseTextEnvStepOutput(
            observations=[], reward=1.0, done=True, metadata={}, postprocessed_action=keep
        )


class CuttingTwice(Cutting):
    """Cuts the first turn, then answers it: the reply follows the kept tokens."""

    def step(self, action):
        out = super().step(action)
        self.turns += 1
        if self.turns == 1:
            return {**out, "observations": [{"role": "user", "content": "and?"}], "done": False}
        return out


def _draw(tok, cfg, script, marker="%%", max_new_tokens=24):
    return _episodes(ScriptedSampler(tok, script, marker), tok, cfg, max_new_tokens=max_new_tokens).draw(
        _examples(tok), seeds=[0, 1], num_generations=2
    )


def test_skyrl_gsm8k_grades_the_final_answer(tiny_model):
    """skyrl's gsm8k env from its registered id: 1 for `#### 5` on 2+3 (the row's answer as the
    reward spec's ground truth), 0 for the same on 4-1; one turn each."""
    _, tok = tiny_model
    cfg = EnvironmentConfig(fn="gsm8k", style="text_gym")
    r = _draw(tok, cfg, ["The answer is #### 5</s>"])
    assert r.env_reward.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert episode_metrics(r)["env/turns"] == 1.0 and episode_metrics(r)["env/action_not_cut"] == 0.0


@pytest.mark.parametrize("reward_turns, expected", [("sum", 1.5), ("last", 1.0)])
def test_a_multi_turn_text_env_sums_or_keeps_the_last_reward(tiny_model, reward_turns, expected):
    """A BaseTextEnv subclass by import path: init's messages are the prompt, its observation joins
    as a user message, the per-turn rewards 0.5 and 1.0 give 1.5 (sum) or 1.0 (last); close()
    once per episode."""
    _, tok = tiny_model
    CLOSED.clear()
    SEEN.clear()
    cfg = EnvironmentConfig(fn="test_text_gym:TwoTurns", style="text_gym", reward_turns=reward_turns)
    r = _draw(tok, cfg, ["first</s>", "second</s>"], marker="again")
    assert r.env_reward.tolist() == [expected] * 4
    assert len(CLOSED) == 4 and len(set(CLOSED)) == 4
    assert sorted(SEEN) == ["first"] * 4 + ["second"] * 4
    assert "What is 2 plus 3? Twice." in tok.decode(r.prompt_ids[0][r.prompt_mask[0].bool()])
    text = tok.decode(r.completion_ids[0][r.attention_mask[0].bool()])
    assert text == "first</s>\n<|user|>again</s>\n<|assistant|>second</s>"
    assert episode_metrics(r)["env/turns"] == 2.0


def test_a_postprocessed_action_cuts_the_sampled_tokens(tiny_model):
    """A strict prefix: the turn's sampled tokens are cut there (fewer trained and attended, the
    kept text decodes to it, the log-probs cut alike); not a prefix: kept whole and counted."""
    _, tok = tiny_model
    script = ["abc STOP junk</s>"]
    whole = _draw(tok, EnvironmentConfig(fn="test_text_gym:OneTurn"), script)
    cfg = EnvironmentConfig(fn="test_text_gym:Cutting", style="text_gym")
    r = _draw(tok, cfg, script)
    for n in range(4):
        kept = r.attention_mask[n].bool()
        assert tok.decode(r.completion_ids[n][kept]) == "abc STOP"
        assert torch.equal(r.trained_mask[n][kept], torch.ones(int(kept.sum()), dtype=torch.long))
    assert int(r.trained_mask.sum()) < int(whole.trained_mask.sum())
    assert int(r.attention_mask.sum()) < int(whole.attention_mask.sum())
    assert episode_metrics(r)["env/action_not_cut"] == 0.0

    bad = replace(cfg, env_config={"keep": "not a prefix"})
    r = _draw(tok, bad, ["abc junk</s>"])
    assert episode_metrics(r)["env/action_not_cut"] == 1.0
    assert tok.decode(r.completion_ids[0][r.attention_mask[0].bool()]) == "abc junk</s>"


def test_a_cut_turn_that_goes_on_writes_its_end_of_turn(tiny_model):
    """A cut that drops the model's end-of-turn token, then a reply: the environment writes the
    end of turn before its message (attended, never trained)."""
    _, tok = tiny_model
    cfg = EnvironmentConfig(fn="test_text_gym:CuttingTwice", style="text_gym")
    r = _draw(tok, cfg, ["abc STOP junk</s>", "5</s>"], marker="and?")
    ids, kept = r.completion_ids[0], r.attention_mask[0].bool()
    assert tok.decode(ids[kept]) == "abc STOP</s>\n<|user|>and?</s>\n<|assistant|>5</s>"
    trained = r.trained_mask[0].bool()
    assert tok.decode(ids[trained]) == "abc STOP5</s>"
    assert int(ids[len("abc STOP")]) == tok.eos_token_id and not bool(trained[len("abc STOP")])


class OneTurn:
    """A native environment of one turn, kept as sampled."""

    def reset(self, row):
        return None

    def step(self, text):
        return None


class _Pieces:
    """A tokenizer whose tokens are strings of two characters."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(["ab", "cd", "ef"][i] for i in ids)


def test_a_token_that_straddles_the_kept_text_is_no_cut():
    rendering = Rendering(_Pieces(), [])
    assert rendering.kept_tokens([0, 1, 2], "abcd") == 2
    assert rendering.kept_tokens([0, 1, 2], "abc") is None  # "cd" straddles its end
    assert rendering.kept_tokens([0, 1, 2], "abcdef") is None  # not a strict prefix
    assert rendering.kept_tokens([0, 1, 2], "x") is None


def test_a_bad_env_id_or_a_missing_package_is_one_paragraph(compose, monkeypatch):
    from grpo_cli.config import validate

    problems = validate(compose(["environment.style=text_gym", "environment.fn=gsm9k"]))
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert "'gsm9k' is not a registered skyrl-gym environment" in problems[0]
    assert "gsm8k" in problems[0] and "my_pkg.envs:MyTextEnv" in problems[0]
    problems = validate(compose(["environment.style=text_gym", "environment.fn=test_environments:Echo"]))
    assert len(problems) == 1 and "not a skyrl-gym BaseTextEnv subclass" in problems[0], problems
    problems = validate(compose(["environment.reward_turns=last", "environment.fn=test_environments:Echo"]))
    assert len(problems) == 1 and "ignored with environment.style=native" in problems[0], problems
    assert validate(compose(["environment.style=text_gym", "environment.fn=aime"])) == []

    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym: ImportError
    problems = validate(compose(["environment.style=text_gym", "environment.fn=gsm8k"]))
    assert len(problems) == 1 and "pip install -e '.[skyrl-gym]' in grpo-cli's folder" in problems[0], (
        problems
    )


@pytest.mark.slow  # an end-to-end run (in this process)
def test_grpo_train_runs_skyrl_gsm8k_with_its_reward(tmp_path):
    """End to end on the tiny model: skyrl's gsm8k from YAML, its reward through the
    `environment` reward, logged each step."""
    from conftest import tiny, train_here

    args = tiny(
        "environment.style=text_gym",
        "environment.fn=gsm8k",
        "reward=[accuracy,environment]",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "hydra.run.dir=run",
    )
    train_here(args, tmp_path / "run")  # (what grpo-train trains, in this process; a failure raises)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(
        "rewards/environment/mean" in r and "env/action_not_cut" in r for r in steps
    )


class StepRaises(TwoTurns):
    def step(self, action):
        raise RuntimeError("the grader is down")


class InitHangs(TwoTurns):
    def init(self, prompt):
        import time

        time.sleep(5)


@pytest.mark.parametrize(
    "cls, message",
    [
        ("StepRaises", r"step\(text\) raised RuntimeError: the grader is down"),
        ("InitHangs", r"reset\(row\) raised TimeoutError"),
    ],
)
def test_a_failing_text_env_is_one_paragraph_or_masked_episodes(tiny_model, cls, message):
    """skyrl-gym's step raising, or its init hanging past environment.timeout_s: one paragraph under
    on_error=raise; under mask the episodes leave the loss (env/errors) and every row stays."""
    from grpo_cli.errors import UserError

    _, tok = tiny_model
    cfg = EnvironmentConfig(fn=f"test_text_gym:{cls}", style="text_gym", max_turns=2, timeout_s=0.5)
    sampler = ScriptedSampler(tok, ["one</s>", "two</s>"], "%%")
    with pytest.raises(UserError, match=rf"environment test_text_gym:{cls}: {message}.*on_error=mask"):
        _episodes(sampler, tok, cfg).draw(_examples(tok), seeds=[0, 1], num_generations=2)
    r = _episodes(sampler, tok, replace(cfg, on_error="mask")).draw(
        _examples(tok), seeds=[0, 1], num_generations=2
    )
    assert r.completion_ids.shape[0] == 4 and int(r.trained_mask.sum()) == 0
    assert episode_metrics(r)["env/errors"] == 1.0
