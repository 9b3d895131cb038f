"""Environments (grpo_cli/environments/): multi-turn episodes. The calculator's safe evaluator on
hostile input; tool errors as observations; the trained sequence is the sampled tokens plus the
environment's, concatenated (no re-rendering, no newline dropped, no end of turn doubled); the
environment's tokens are attended and never trained (exactly zero gradient, a sentinel reply never
in the trained span); episodes depend on their prompt's seed alone; a failing environment is one
paragraph, or a masked episode; and grpo-train runs the presets end to end."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch
from conftest import grpo, tiny, train_here

from grpo_cli.config.schema import DataConfig, EnvironmentConfig
from grpo_cli.data import Example
from grpo_cli.environments import Reply, ToolEnv, environment_factory
from grpo_cli.environments.calculator import calc, evaluate
from grpo_cli.environments.episodes import Episodes, episode_metrics, turn_seed
from grpo_cli.environments.path import RolloutPath
from grpo_cli.environments.rendering import Rendering
from grpo_cli.errors import UserError
from grpo_cli.logprobs import token_logprobs
from grpo_cli.precision import resolve_precision
from grpo_cli.rewards import conversation
from grpo_cli.rollout import ROLE_CODES, left_pad, single_turn
from grpo_cli.samplers import Reprefill
from grpo_cli.samplers.builtin import BuiltinSampler

# ----------------------------------------------------------------------------- the calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12-17", "-5"),
        ("3*(4+5)", "27"),
        (" 7 / 2 ", "3.5"),
        ("2**10", "1024"),
        ("-(-3)", "3"),
        ("6 × 7", "42"),
        ("10 // 3 + 10 % 3", "4"),
    ],
)
def test_the_calculator_computes_arithmetic(expression, value):
    assert calc(expression) == value


@pytest.mark.parametrize(
    "hostile, reason",
    [
        ("9**9**9", "digits"),
        ("10**101", "digits"),
        ("1e308*10", "digits"),
        ("__import__('os')", "not arithmetic"),
        ("open('/etc/passwd').read()", "not arithmetic"),
        ("(1).__class__", "not arithmetic"),
        ("'a'*10", "not arithmetic"),
        ("x", "not arithmetic"),
        ("1/0", "division by zero"),
        ("(-8)**0.5", "not a real number"),
        ("1+" * 200 + "1", "longer than"),
        ("+".join(["1"] * 90), "terms"),
        ("", "empty"),
        ("2+", "does not parse"),
    ],
)
def test_the_calculator_refuses_hostile_input_fast(hostile, reason):
    tick = time.perf_counter()
    with pytest.raises(ValueError, match=reason):
        evaluate(hostile)
    assert time.perf_counter() - tick < 1.0  # bounded: nothing big is ever computed


def _slow(x: str) -> str:
    """Sleeps."""
    time.sleep(5)
    return x


def _broken(x: str) -> str:
    """Raises."""
    raise RuntimeError("backend down")


def test_tool_calls_errors_and_timeouts_are_observations():
    env = ToolEnv([calc, _slow, _broken], timeout_s=0.2)
    assert env.stop == ["</calc>", "</_slow>", "</_broken>"]
    assert env.step("I will compute <calc>2+3</calc>") == Reply(
        "<result>5</result>", role="tool", tool_call=True
    )
    bad = env.step("<calc>__import__('os')</calc>")
    assert bad.error and bad.tool_call and "not arithmetic" in bad.content
    unknown = env.step("<search>weather</search>")
    assert unknown.error and "no tool named search" in unknown.content
    tick = time.perf_counter()
    slow = env.step("<_slow>x</_slow>")
    assert slow.error and "timeout_s" in slow.content and time.perf_counter() - tick < 2
    assert "backend down" in env.step("<_broken>x</_broken>").content
    assert env.step("The answer is 5.").done  # no call: the episode ends
    messages = env.reset({"prompt": "What is 2 plus 3?"})
    assert messages[0]["role"] == "system" and "<calc>12-17</calc>" in messages[0]["content"]


# ----------------------------------------------------------------------------- scripted episodes

# A chat template whose assistant turns end with the EOS token (</s>), as real ones do.
SENTINEL = "ZQZ"


def sentinel(expression: str) -> str:
    """Answers with a sentinel.

    Args:
        expression: anything
    """
    return SENTINEL


class ScriptedSampler:
    """A samplers.Sampler whose completions are fixed texts: turn t of every episode writes
    script[t] (t: the number of environment replies in the sequence so far), cut at
    max_new_tokens. Its log-probs are filled in afterwards from the model (the test's)."""

    tolerance = (1e-4, 5e-4)

    def __init__(self, tok, script: list[str], reply_marker: str):
        self.tok, self.script, self.marker = tok, script, reply_marker
        self.calls = []

    def sampling(self):
        import contextlib

        return contextlib.nullcontext()

    def generate(
        self,
        prompts,
        *,
        seeds=None,
        num_generations,
        greedy=False,
        ignore_eos=False,
        max_new_tokens=None,
        stop=None,
    ):
        self.calls.append({"prompts": prompts, "stop": stop, "max_new_tokens": max_new_tokens})
        rows = []
        for p in prompts:
            turn = self.tok.decode(p).count(self.marker)
            ids = self.tok(self.script[turn], add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows += [ids] * num_generations
        C = max(len(r) for r in rows)
        ids = torch.full((len(rows), C), self.tok.pad_token_id)
        mask = torch.zeros((len(rows), C), dtype=torch.long)
        for n, r in enumerate(rows):
            ids[n, : len(r)], mask[n, : len(r)] = torch.tensor(r), 1
        pids, pmask = left_pad(prompts, self.tok.pad_token_id, "cpu")
        G = num_generations
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        return single_turn(
            G,
            pids.repeat_interleave(G, 0),
            pmask.repeat_interleave(G, 0),
            ids,
            mask,
            truncated,
            torch.zeros(ids.shape),
        )

    def session(self, prompts, num_generations):
        return Reprefill(self, prompts, num_generations)

    def sync(self, policy):
        pass

    def close(self):
        pass


def _examples(tok, questions=("What is 2 plus 3?", "What is 4 minus 1?"), answers=("5", "3")):
    out = []
    for q, a in zip(questions, answers):
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(Example(messages, tok(text, add_special_tokens=False)["input_ids"], {"answer": a}))
    return out


def _episodes(sampler, tok, cfg: EnvironmentConfig, max_new_tokens=24) -> RolloutPath:
    """The environment's episodes on `sampler` (draw: environments.path.run_episodes)."""
    rendering = Rendering(
        tok, [tok.eos_token_id], data=DataConfig(), describe=cfg.fn or f"tools [{', '.join(cfg.tools)}]"
    )
    episodes = Episodes(
        environment_factory(cfg), cfg, rendering, pad_id=tok.pad_token_id, max_new_tokens=max_new_tokens
    )
    return RolloutPath(sampler, episodes)


def test_tool_output_is_attended_and_never_trained(tiny_model, monkeypatch):
    """A scripted policy calls a tool that answers with a sentinel, then answers: the sentinel is
    in the sequence, attended, and out of the trained span; the loss (policy term and KL) has
    exactly zero gradient at every environment position, and every consumer counts the sampled
    tokens only (test_rollout's update, on the episode)."""
    from test_rollout import _update

    model, tok = tiny_model
    cfg = EnvironmentConfig(tools=["test_environments:sentinel"])
    sampler = ScriptedSampler(tok, ["<sentinel>1+1</sentinel>junk", "5</s>"], reply_marker=SENTINEL)
    r = _episodes(sampler, tok, cfg).draw(_examples(tok), seeds=[1, 2], num_generations=2)
    assert sampler.calls[0]["stop"] == ["</sentinel>"]
    assert r.roles is not None and r.num_generations == 2
    for n in range(4):
        ids, attended, trained = r.completion_ids[n], r.attention_mask[n].bool(), r.trained_mask[n].bool()
        whole = tok.decode(ids[attended])
        # The turn was cut right after the stop string ("junk" never sampled into the sequence).
        assert whole == f"<sentinel>1+1</sentinel><result>{SENTINEL}</result>5</s>"
        assert SENTINEL not in tok.decode(ids[trained]) and SENTINEL in tok.decode(ids[attended & ~trained])
        assert tok.decode(ids[attended & ~trained]) == f"<result>{SENTINEL}</result>"
        assert set(r.roles[n][attended & ~trained].tolist()) == {ROLE_CODES["tool"]}
        assert conversation(tok, ids, r.roles[n]) == [
            {"role": "assistant", "content": "<sentinel>1+1</sentinel>"},
            {"role": "tool", "content": f"<result>{SENTINEL}</result>"},
            {"role": "assistant", "content": "5"},
        ]
    assert episode_metrics(r)["env/tool_calls"] == 1.0 and episode_metrics(r)["env/turns"] == 2.0
    assert 0 < episode_metrics(r)["env/env_token_share"] < 1

    # The trainer's view: its own log-probs as the sampler's (a scripted policy has none).
    with torch.no_grad():
        logps = token_logprobs(model, *r.inputs(), temperature=1.0, num_generations=2)
    r = replace(r, sampler_logps=logps * r.trained_mask)
    env = r.attention_mask.bool() & ~r.trained_mask.bool()
    updated, calls, grads = _update(model, r, -30.0, monkeypatch)
    (call,) = calls
    assert torch.equal(call["mask"].bool(), r.trained_mask.bool())
    (dlogps,) = torch.autograd.grad(call["loss"], call["logps"])
    assert bool((dlogps[env] == 0).all()) and bool((dlogps[r.trained_mask.bool()] != 0).any())
    assert bool((call["weights"][env] == 1.0).all())
    assert updated.stats.mismatch_tokens == updated.stats.entropy_tokens == int(r.trained_mask.sum())


def test_a_second_turn_joins_the_sampled_tokens_as_the_template_would_render_them(tiny_model):
    """feedback: a wrong answer, the environment's user turn, a right one. The sequence is the
    prompt, the sampled tokens and the environment's, concatenated, and equals the chat
    template's rendering of the same conversation: no newline dropped at the turn boundary, no
    end-of-turn token doubled."""
    from grpo_cli.environments.feedback import TRY_AGAIN

    _, tok = tiny_model
    cfg = EnvironmentConfig(fn="grpo_cli.environments.feedback:Feedback", max_turns=2, max_reply_tokens=128)
    sampler = ScriptedSampler(tok, ["7</s>", "5</s>"], reply_marker="Try again")
    examples = _examples(tok)
    r = _episodes(sampler, tok, cfg).draw(examples[:1], seeds=[3], num_generations=2)
    ids = torch.cat(
        [r.prompt_ids[0][r.prompt_mask[0].bool()], r.completion_ids[0][r.attention_mask[0].bool()]]
    )
    rendered = tok.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": TRY_AGAIN},
            {"role": "assistant", "content": "5"},
        ],
        tokenize=False,
    )
    assert tok.decode(ids) + "\n" == rendered  # the last turn's newline follows the EOS: not sampled
    assert r.env_reward.tolist() == [1.0, 1.0]
    assert [m["role"] for m in conversation(tok, r.completion_ids[0], r.roles[0])] == [
        "assistant",
        "user",
        "assistant",
    ]
    assert conversation(tok, r.completion_ids[0], r.roles[0])[1]["content"] == TRY_AGAIN
    # Out of turns while still wrong: the episode ends (counted), not truncated, reward 0.
    wrong = ScriptedSampler(tok, ["7</s>", "8</s>"], reply_marker="Try again")
    r = _episodes(wrong, tok, cfg).draw(examples[:1], seeds=[3], num_generations=2)
    assert r.env_reward.tolist() == [0.0, 0.0] and not r.truncated.any()
    assert episode_metrics(r)["env/out_of_turns"] == 1.0


def test_budgets_cut_turns_and_replies_and_mark_the_episode_truncated(tiny_model):
    _, tok = tiny_model
    script = ["<sentinel>1</sentinel>", "<sentinel>2</sentinel>", "<sentinel>3</sentinel>", "no"]
    # A turn longer than its budget: truncated.
    r = _episodes(
        ScriptedSampler(tok, script, SENTINEL),
        tok,
        EnvironmentConfig(tools=["test_environments:sentinel"]),
        max_new_tokens=10,
    ).draw(_examples(tok)[:1], seeds=[0], num_generations=2)
    assert r.truncated.all() and int(r.attention_mask[0].sum()) == 10
    # A reply longer than max_reply_tokens: cut there and counted.
    cfg = EnvironmentConfig(tools=["test_environments:sentinel"], max_reply_tokens=5, max_turns=2)
    r = _episodes(ScriptedSampler(tok, script, "<resu"), tok, cfg).draw(
        _examples(tok)[:1], seeds=[0], num_generations=2
    )
    env = r.attention_mask[0].bool() & ~r.trained_mask[0].bool()
    assert tok.decode(r.completion_ids[0][env]) == "<resu" and episode_metrics(r)["env/replies_cut"] == 1.0
    # The episode's budget: no room for the model after the reply -> truncated.
    cfg = EnvironmentConfig(tools=["test_environments:sentinel"], max_episode_tokens=30)
    r = _episodes(ScriptedSampler(tok, script, SENTINEL), tok, cfg).draw(
        _examples(tok)[:1], seeds=[0], num_generations=2
    )
    assert r.truncated.all() and int(r.attention_mask.sum(-1).max()) <= 30


# ----------------------------------------------------------------------------- failures


class Raising:
    stop = ["!"]

    def reset(self, row):
        return None

    def step(self, text):
        raise RuntimeError("the environment broke")


class WrongType(Raising):
    def step(self, text):
        return 42


def test_an_environment_that_raises_is_one_paragraph_or_a_masked_episode(tiny_model):
    _, tok = tiny_model
    script = ["go!", "x</s>"]  # (reply marker "%%": never in the sequence, every turn is turn 0)
    cfg = EnvironmentConfig(fn="test_environments:Raising")
    with pytest.raises(
        UserError,
        match=r"environment test_environments:Raising: step\(text\) raised RuntimeError: "
        r"the environment broke \(episode 0 of the prompt .*on_error=mask",
    ):
        _episodes(ScriptedSampler(tok, script, "%%"), tok, cfg).draw(
            _examples(tok), seeds=[0, 1], num_generations=2
        )
    with pytest.raises(UserError, match="step\\(\\) returned int 42 .* must return a Reply, a str"):
        _episodes(
            ScriptedSampler(tok, script, "%%"), tok, EnvironmentConfig(fn="test_environments:WrongType")
        ).draw(_examples(tok), seeds=[0, 1], num_generations=2)
    r = _episodes(ScriptedSampler(tok, script, "%%"), tok, replace(cfg, on_error="mask")).draw(
        _examples(tok), seeds=[0, 1], num_generations=2
    )
    assert int(r.trained_mask.sum()) == 0 and int(r.attention_mask.sum()) > 0
    assert episode_metrics(r)["env/errors"] == 1.0


class Counting:
    """Declares its own metric: `asked`, one per turn the environment answers."""

    stop = ["!"]
    metrics = ("asked",)

    def reset(self, row):
        return None

    def step(self, text):
        return Reply("and?", metrics={"asked": 1})


class Undeclared(Counting):
    metrics = ()


def test_an_environment_declares_its_own_metrics(tiny_model):
    """The episode loop reads the metric names an environment declares (its `metrics`), sums each
    reply's values over the episode and logs env/<name> as the mean per episode; a reply with a
    name it did not declare is one paragraph naming the fix."""
    _, tok = tiny_model
    script = ["go!"]  # (reply marker "%%": never in the sequence, every turn is turn 0)
    cfg = EnvironmentConfig(fn="test_environments:Counting", max_turns=3)
    r = _episodes(ScriptedSampler(tok, script, "%%"), tok, cfg).draw(
        _examples(tok), seeds=[0, 1], num_generations=2
    )
    assert r.stat_names[-1] == "asked"
    metrics = episode_metrics(r)
    assert metrics["env/asked"] == 3.0 == metrics["env/turns"]  # each turn stepped (the last reply unsent)
    with pytest.raises(UserError, match="reports the metric 'asked', which the environment does not declare"):
        _episodes(
            ScriptedSampler(tok, script, "%%"), tok, replace(cfg, fn="test_environments:Undeclared")
        ).draw(_examples(tok), seeds=[0, 1], num_generations=2)


# ----------------------------------------------------------------------------- real sampling


class Echo:
    """Answers every turn with a fixed message."""

    stop = [chr(c) for c in range(33, 127)]  # every printable character: turns of a token or two

    def reset(self, row):
        return None

    def step(self, text):
        return "Go on."


def test_episodes_depend_on_their_prompt_seed_alone(tiny_model):
    """Turn seeds derive from the prompt's seed: a prompt's episodes are the same whichever other
    prompts share the call (what makes 2 processes sample what 1 does), and turn 0 is the
    single-turn draw of the same seed."""
    model, tok = tiny_model
    precision = resolve_precision("fp32", torch.device("cpu"))
    from grpo_cli.config.schema import SamplerConfig

    s = BuiltinSampler(
        SamplerConfig(max_new_tokens=6),
        model,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        precision=precision,
        fast_decode=True,
        tokenizer=tok,
    )
    cfg = EnvironmentConfig(fn="test_environments:Echo", max_turns=3)
    ex = _examples(tok)
    both = _episodes(s, tok, cfg, max_new_tokens=6).draw(ex, seeds=[11, 12], num_generations=3)
    alone = _episodes(s, tok, cfg, max_new_tokens=6).draw(ex[1:], seeds=[12], num_generations=3)
    C = alone.completion_ids.shape[1]
    assert torch.equal(both.completion_ids[3:, :C], alone.completion_ids)
    assert torch.equal(both.trained_mask[3:, :C], alone.trained_mask)
    assert torch.allclose(both.sampler_logps[3:, :C], alone.sampler_logps, atol=1e-5)
    assert float(episode_metrics(both)["env/turns"]) > 1  # it did run several turns
    single = s.generate([ex[1].prompt_ids], seeds=[12], num_generations=3)
    for n in range(3):
        assistant = (alone.roles[n] == ROLE_CODES["assistant"]).tolist()
        k = assistant.index(False) if False in assistant else len(assistant)
        assert torch.equal(alone.completion_ids[n, :k], single.completion_ids[n, :k])
    assert turn_seed(12, 0, 1) != turn_seed(12, 1, 1) != turn_seed(12, 0, 2)


# ----------------------------------------------------------------------------- config and CLI


def test_bad_environment_settings_are_named_before_loading(compose):
    from grpo_cli.config import validate

    problems = validate(compose(["environment.fn=nosuch_pkg.env:Env"]))
    assert any("environment.fn='nosuch_pkg.env:Env'" in p and "cannot be imported" in p for p in problems)
    problems = validate(compose(["environment=calculator", "environment.fn=test_environments:Echo"]))
    assert any("are both set; choose one" in p for p in problems)
    problems = validate(
        compose(["environment=calculator", "environment.on_error=ignore", "environment.max_turns=0"])
    )
    assert any("environment.on_error='ignore'" in p for p in problems)
    assert any("environment.max_turns=0" in p for p in problems)
    problems = validate(compose(["environment=calculator", "sampler=vllm"]))
    assert any("set sampler.max_model_len" in p for p in problems)
    assert validate(compose(["environment=calculator"])) == validate(compose([]))
    assert validate(compose(["environment=feedback"])) == validate(compose([]))


@pytest.mark.slow  # an end-to-end run (in this process)
@pytest.mark.parametrize("preset", ["calculator", "feedback"])
def test_grpo_train_runs_an_environment_preset(tmp_path, preset):
    out = tmp_path / "run"
    # What grpo-train trains, in this process (a failure raises).
    train_here(
        tiny(f"environment={preset}", "trainer.max_steps=2", "trainer.eval_steps=0", "data.eval_size=4"), out
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/turns" in r]
    assert len(steps) == 2 and all(r["env/turns"] >= 1 for r in steps)
    assert all(0 <= r["env/env_token_share"] < 1 for r in steps)


class _NoSession:
    """The built-in sampler seen as any other sampler: the default session (Reprefill), the
    history given again every turn."""

    def __init__(self, sampler):
        self.inner, self.tolerance = sampler, sampler.tolerance

    def sampling(self):
        return self.inner.sampling()

    def generate(self, prompts, **kw):
        return self.inner.generate(prompts, **kw)

    def session(self, prompts, num_generations):
        return Reprefill(self, prompts, num_generations)


def test_the_kv_cache_kept_across_turns_samples_what_the_whole_history_does(tiny_model):
    """The built-in sampler's session (the KV cache kept across turns, only the new tokens fed)
    draws the same episodes as giving the sampler each episode's whole sequence again."""
    model, tok = tiny_model
    from grpo_cli.config.schema import SamplerConfig

    s = BuiltinSampler(
        SamplerConfig(max_new_tokens=6),
        model,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        precision=resolve_precision("fp32", torch.device("cpu")),
        fast_decode=True,
        tokenizer=tok,
    )
    cfg = EnvironmentConfig(fn="test_environments:Echo", max_turns=4)
    ex = _examples(tok)
    for greedy in (False, True):
        kept = _episodes(s, tok, cfg, max_new_tokens=6).draw(
            ex, seeds=[5, 6], num_generations=3, greedy=greedy
        )
        again = _episodes(_NoSession(s), tok, cfg, max_new_tokens=6).draw(
            ex, seeds=[5, 6], num_generations=3, greedy=greedy
        )
        assert torch.equal(kept.completion_ids, again.completion_ids)
        assert torch.equal(kept.trained_mask, again.trained_mask) and torch.equal(kept.roles, again.roles)
        assert torch.allclose(kept.sampler_logps, again.sampler_logps, atol=1e-4)
        assert float(episode_metrics(kept)["env/turns"]) > 2


# ----------------------------------------------------------------------------- processes and resume

EPISODES = tiny(
    "environment.fn=reliability_helpers:Chatty",
    "environment.max_turns=3",
    "sampler.max_new_tokens=4",
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",
    "optimizer.learning_rate=1e-3",
    "trainer.prompts_per_step=2",
    "trainer.max_steps=3",
    "trainer.save_steps=1",
    "trainer.keep_last=5",
    "trainer.eval_before=false",
    "data.eval_size=0",
    "trainer.log_completions=8",
)


def _episode_rows(run):
    from test_engine import read_metrics

    from grpo_cli.samples import read_records

    skip = ("time", "step_time", "tokens_per_second", "learning_rate", "memory/")
    rows = [{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(run)]
    return rows, read_records(run)


def test_episodes_are_the_same_on_two_processes_and_after_a_kill_and_resume(tmp_path):
    """Multi-turn episodes sample what one process samples when two share the step (the logged
    conversations, rewards and env/* metrics), and a run killed after a checkpoint and resumed
    with trainer.resume=auto continues bit for bit. (The processes are the point of the two-process
    run and the kill; the uninterrupted run and the resume train in this process, with one torch
    thread as the processes do: the same numbers.)"""
    runs = {name: tmp_path / name for name in ("one", "two", "killed")}
    for name, extra, fault in [
        ("two", ["trainer.num_processes=2"], None),
        ("killed", [], "kill_after_save:2"),
    ]:
        res = grpo([*EPISODES, *extra, f"hydra.run.dir={runs[name]}"], tmp_path, fault=fault)
        assert res.returncode == (-9 if fault else 0), res.stdout[-3000:] + res.stderr[-3000:]
    train_here(EPISODES, runs["one"])
    train_here([*EPISODES, "trainer.resume=auto"], runs["killed"])
    one_rows, one_logged = _episode_rows(runs["one"])
    assert [r["step"] for r in one_rows] == [1, 2, 3] and all(r["env/turns"] > 1 for r in one_rows)
    assert any("[user] ok" in r["completion"] or "[tool] ok" in r["completion"] for r in one_logged)
    resumed_rows, resumed_logged = _episode_rows(runs["killed"])
    assert resumed_rows == one_rows and resumed_logged == one_logged  # bit for bit
    two_rows, two_logged = _episode_rows(runs["two"])
    same = ("step", "group", "prompt", "completion", "rewards", "reward", "length", "truncated")
    assert [[r[k] for k in same] for r in two_logged] == [[r[k] for k in same] for r in one_logged]
    for a, b in zip(one_rows, two_rows):
        assert {k: v for k, v in a.items() if k.startswith("env/") or k == "reward"} == {
            k: v for k, v in b.items() if k.startswith("env/") or k == "reward"
        }


# A tiny chat template that renders tools as Qwen2.5's does (their schemas in a system turn, a
# call in <tool_call> tags, the result as a <tool_response> in a user turn).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}."
    ' Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call></s>\n{%- endif %}'
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}"
    "</tool_response></s>\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_the_native_tool_protocol_on_a_template_that_renders_tools(tiny_model):
    """protocol=native: the template lists the tools, the model's turn ends with a <tool_call>
    and its end of turn, the result comes back as the template's tool message; the sequence
    equals the template's rendering of that conversation, and the tool's output is never
    trained. A template that cannot render tools is refused with one paragraph."""
    import copy

    from grpo_cli.config.schema import Config
    from grpo_cli.environments import tool_schema
    from grpo_cli.environments.episodes import environment_episodes

    _, tok = tiny_model
    tok = copy.deepcopy(tok)
    tok.chat_template = TOOLS_TEMPLATE
    cfg = EnvironmentConfig(tools=["test_environments:sentinel"], protocol="native", max_reply_tokens=128)
    call = '<tool_call>{"name": "sentinel", "arguments": {"expression": "1+1"}}</tool_call>'
    sampler = ScriptedSampler(tok, [call + "</s>", "5</s>"], reply_marker=SENTINEL)
    r = _episodes(sampler, tok, cfg, max_new_tokens=128).draw(
        _examples(tok)[:1], seeds=[0], num_generations=2
    )
    assert sampler.calls[0]["stop"] == []  # the model ends its own turn
    ids = torch.cat(
        [r.prompt_ids[0][r.prompt_mask[0].bool()], r.completion_ids[0][r.attention_mask[0].bool()]]
    )
    rendered = tok.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": SENTINEL},
            {"role": "assistant", "content": "5"},
        ],
        tools=[tool_schema(sentinel)],
        tokenize=False,
    )
    assert tok.decode(ids) + "\n" == rendered
    trained = r.trained_mask[0].bool()
    assert SENTINEL not in tok.decode(r.completion_ids[0][trained])
    assert episode_metrics(r)["env/tool_calls"] == 1.0 and episode_metrics(r)["env/tool_errors"] == 0.0
    # A call that does not parse, or names no tool: an error the model reads, not the run's.
    bad = ScriptedSampler(tok, ["<tool_call>{not json}</tool_call></s>", "5</s>"], reply_marker="error")
    r = _episodes(bad, tok, cfg, max_new_tokens=128).draw(_examples(tok)[:1], seeds=[0], num_generations=2)
    assert episode_metrics(r)["env/tool_errors"] == 1.0 and episode_metrics(r)["env/turns"] == 2.0
    # SmolLM2-like templates (role and content only) cannot carry it: refused.
    whole = Config()
    whole.environment = cfg
    with pytest.raises(UserError, match="does not render tools .* environment.protocol=tag"):
        environment_episodes(whole, tokenizer=tiny_model[1], eos_ids=[2], pad_id=0)
    tok.chat_template = TOOLS_TEMPLATE
    assert environment_episodes(whole, tokenizer=tok, eos_ids=[2], pad_id=0) is not None


def test_the_default_session_draws_what_the_built_in_kv_cache_session_draws(tiny_model):
    """samplers.Reprefill (each later turn gives the whole sequence again: any sampler's default)
    and the built-in sampler's Session (its KV cache kept, only the new tokens fed) draw the same
    tokens and log-probs for the same seeds, turn after turn; turn 0 is the plain generate call.
    A single-turn rollout carries its roles: every attended token the assistant's."""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers import Turn

    model, tok = tiny_model
    s = BuiltinSampler(
        SamplerConfig(max_new_tokens=5),
        model,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        precision=resolve_precision("fp32", torch.device("cpu")),
        fast_decode=True,
        tokenizer=tok,
    )
    prompts, G = [ex.prompt_ids for ex in _examples(tok)], 2
    reply = tok("<|user|>Go on.</s>\n<|assistant|>", add_special_tokens=False)["input_ids"]
    kv, again = s.session(prompts, G), Reprefill(s, prompts, G)
    histories = {name: [[] for _ in range(len(prompts) * G)] for name in ("kv", "again")}
    rows = list(range(len(prompts) * G))
    for turn in range(3):
        seeds = [7, 8] if turn == 0 else [turn_seed(7 + n // G, n % G, turn) for n in rows]
        how = Turn(seeds, greedy=False, ignore_eos=True, max_new_tokens=5, stop=[])
        a = kv.turn(rows, histories["kv"], how)
        b = again.turn(rows, histories["again"], how)
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, la), (_, lb) in zip(a, b):
            assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-5)
        for name, drawn in (("kv", a), ("again", b)):
            for n, (tokens, _) in enumerate(drawn):
                histories[name][n] += tokens + reply
        if turn == 0:
            single = s.generate(prompts, seeds=[7, 8], num_generations=G, ignore_eos=True)
            assert [t for t, _ in a] == [
                row[m.bool()].tolist() for row, m in zip(single.completion_ids, single.attention_mask)
            ]
            assert torch.equal(single.roles, single.attention_mask * ROLE_CODES["assistant"])
            assert not single.is_episode and single.env_reward.isnan().all()
