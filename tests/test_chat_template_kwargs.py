"""model.chat_template_kwargs (TRL's name): the policy's chat template gets them wherever grpo-cli
renders it, the data's prompts (and so grpo-train's held-out sets), an environment's prompt, tool
check and replies, grpo-eval's prompts and the warm-up's demonstrations; the presets that set them
(Qwen3's enable_thinking switch) compose; a key grpo-cli sets itself, or a value that is not plain
YAML, is one paragraph.

The tiny model's tokenizer is given a template that refuses to render without enable_thinking
(transformers' raise_exception), and writes [no-think] after the generation prompt when it is
false, as Qwen3's writes an empty <think></think>: a rendering anywhere that forgot the kwargs
fails, and one that passed them shows where the model's turn starts."""

from __future__ import annotations

import json

import pytest
from conftest import composed, tiny
from test_environments import SENTINEL, ScriptedSampler

from grpo_cli.chat_template import check_template_kwargs, render, template_kwargs, with_template_kwargs
from grpo_cli.config import to_typed, validate

MARK = "[no-think]"
_NEEDS_KWARG = (
    "{% if enable_thinking is not defined %}{{ raise_exception('rendered without the template kwargs') }}"
    "{% endif %}"
)
_GENERATION = (
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is false %}"
    + MARK
    + "{% endif %}{% endif %}"
)
# The tiny template, each turn ended by the EOS (</s>), as Qwen3's by <|im_end|>.
STRICT = (
    _NEEDS_KWARG
    + "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    + _GENERATION
)
# The same, listing the tools it is given and rendering a tool message as a user turn.
STRICT_TOOLS = (
    _NEEDS_KWARG
    + "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    ".</s>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>"
    "{{ m['content'] }}</tool_response></s>\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endif %}"
    "{% endfor %}" + _GENERATION
)
NO_THINKING = {"enable_thinking": False}


# A few arithmetic problems, without the wide held-out set unless a test asks for it.
SMALL = ("data.num_examples=8", "data.eval_size=4", "data.wide_eval_max_operand=0")


def _config(*overrides: str, template: str = STRICT, kwargs: dict | None = NO_THINKING, base=tiny):
    """The tiny run's typed config (`base`: its overrides) with `template` as model.chat_template
    and `kwargs` as model.chat_template_kwargs (set in Python: a Jinja template is awkward on a
    command line)."""
    cfg = composed(base(*overrides))
    cfg.model.chat_template = template
    cfg.model.chat_template_kwargs = kwargs or {}
    assert validate(cfg) == []
    return to_typed(cfg)


def _policy_tokenizer(cfg):
    """The policy's tokenizer, as grpo-train and grpo-eval build it from the model section."""
    from grpo_cli.build import build_tokenizer

    return build_tokenizer(cfg, lambda *a, **k: None)[1]


# ----------------------------------------------------------------------------- the data's prompts


def test_the_policys_tokenizer_carries_the_kwargs_and_a_copy_of_them():
    cfg = _config(*SMALL, kwargs={"enable_thinking": False, "nested": {"a": [1, None]}})
    tok = _policy_tokenizer(cfg)
    assert template_kwargs(tok) == {"enable_thinking": False, "nested": {"a": [1, None]}}
    template_kwargs(tok)["nested"]["a"].append(2)  # (a copy: the config's value is untouched)
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False, "nested": {"a": [1, None]}}
    assert render(tok, [{"role": "user", "content": "Hi"}]) == "<|user|>Hi</s>\n<|assistant|>" + MARK


@pytest.mark.parametrize("kwargs, ends", [(NO_THINKING, "<|assistant|>" + MARK), ({}, "<|assistant|>")])
def test_the_data_prompts_are_rendered_with_the_kwargs(kwargs, ends):
    """Training and held-out prompts (build_data), and the wide held-out set (build_wide_eval);
    without kwargs the template's own default (no mark)."""
    from grpo_cli.build import build_data, build_wide_eval, read_data, read_wide_eval

    template = STRICT if kwargs else STRICT.removeprefix(_NEEDS_KWARG)  # (no kwargs: no guard)
    cfg = _config(*SMALL, "data.wide_eval_max_operand=30", template=template, kwargs=kwargs)
    tok = _policy_tokenizer(cfg)
    data = build_data(cfg, read_data(cfg), tok)
    wide = build_wide_eval(cfg, read_wide_eval(cfg), tok)
    assert data.train and data.eval and wide
    for ex in data.train + data.eval + wide:
        text = tok.decode(ex.prompt_ids)
        assert text.startswith("<|user|>What is") and text.endswith(ends), text
        assert text.count(MARK) == (1 if kwargs else 0)


def test_a_chat_prompt_with_a_system_prompt_is_rendered_with_the_kwargs(tmp_path):
    """A file's chat-message prompts, data.system_prompt added."""
    from grpo_cli.build import build_data, read_data

    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)} for i in range(6)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = [
        "data=jsonl",
        f"data.path={tmp_path / 'chat.jsonl'}",
        "data.eval_size=2",
        "data.system_prompt=Be brief.",
    ]
    cfg = _config(*data, base=lambda *o: ["model=tiny", *o])
    tok = _policy_tokenizer(cfg)
    data = build_data(cfg, read_data(cfg), tok)
    text = tok.decode(data.train[0].prompt_ids)
    assert text.startswith("<|system|>Be brief.</s>\n<|user|>Say ") and text.endswith("<|assistant|>" + MARK)


# ----------------------------------------------------------------------------- an environment


def test_an_environments_prompt_tool_check_and_replies_are_rendered_with_the_kwargs():
    """environment.protocol=native: the check that the template lists the tools, the episode's
    prompt (the template's tool list) and the tool's reply (the template's text between the
    model's end of turn and its next turn) all carry the kwargs: the model's turn starts after
    the mark both times. Without the kwargs the same template fails the tool check."""
    from grpo_cli.data import Example
    from grpo_cli.environments.episodes import environment_episodes
    from grpo_cli.environments.path import RolloutPath
    from grpo_cli.errors import UserError

    cfg = _config(
        *SMALL,
        "environment.tools=[test_environments:sentinel]",
        "environment.protocol=native",
        "environment.max_reply_tokens=128",
        "sampler.max_new_tokens=128",
        template=STRICT_TOOLS,
    )
    tok = _policy_tokenizer(cfg)
    ids = dict(tokenizer=tok, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    episodes = environment_episodes(cfg, **ids)
    call = '<tool_call>{"name": "sentinel", "arguments": {"expression": "1+1"}}</tool_call>'
    sampler = ScriptedSampler(tok, [call + "</s>", "5</s>"], reply_marker=SENTINEL)
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    example = Example(
        question, tok(render(tok, question), add_special_tokens=False)["input_ids"], {"answer": "5"}
    )
    r = RolloutPath(sampler, episodes).draw([example], seeds=[0], num_generations=1)
    text = tok.decode(r.prompt_ids[0][r.prompt_mask[0].bool()]) + tok.decode(
        r.completion_ids[0][r.attention_mask[0].bool()]
    )
    assert text == (
        "<|system|>Tools: sentinel.</s>\n<|user|>What is 2 plus 3?</s>\n<|assistant|>"
        + MARK
        + call
        + f"</s>\n<|user|><tool_response>{SENTINEL}</tool_response></s>\n<|assistant|>"
        + MARK
        + "5</s>"
    )

    with_template_kwargs(tok, {})  # the same tokenizer without them: the template cannot render
    with pytest.raises(UserError, match="does not render tools"):
        environment_episodes(cfg, **ids)


# ----------------------------------------------------------------------------- grpo-eval


def test_grpo_eval_samples_from_prompts_rendered_with_the_kwargs(monkeypatch):
    """grpo-eval's in-process evaluator (the console script's evaluate_model): the prompts it
    grades, the held-out and the wide sets, carry the mark."""
    from grpo_cli.cli.eval import evaluate_model
    from grpo_cli.roles import Rollouts

    graded, grade = [], Rollouts.grade

    def recording(self, examples, *args, **kwargs):
        graded.extend(self.tokenizer.decode(ex.prompt_ids) for ex in examples)
        return grade(self, examples, *args, **kwargs)

    monkeypatch.setattr(Rollouts, "grade", recording)
    cfg = _config(*SMALL, "data.wide_eval_max_operand=30", "sampler.max_new_tokens=2")
    result = evaluate_model(cfg, samples=0, num_prompts=2, log=lambda *a, **k: None)
    assert result["num_prompts"] == 2
    assert len(graded) == 4 and all(text.endswith("<|assistant|>" + MARK) for text in graded), graded


# ----------------------------------------------------------------------------- the warm-up


@pytest.mark.parametrize("from_file", [False, True], ids=["data-source", "sft.path"])
def test_the_warm_ups_demonstrations_are_rendered_with_the_kwargs(tmp_path, from_file):
    """sft=demonstrations: the data source's own (its training prompts) and sft.path's rows (TRL's
    prompt-completion and messages formats)."""
    from grpo_cli.build import build_data, read_data
    from grpo_cli.sft import read_demonstrations

    rows = [
        {"prompt": "What is 1 plus 1?", "completion": "2"},
        {
            "messages": [
                {"role": "user", "content": "What is 2 plus 2?"},
                {"role": "assistant", "content": "4"},
            ]
        },
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = [f"sft.path={tmp_path / 'sft.jsonl'}"] if from_file else []
    cfg = _config(*SMALL, "sft=demonstrations", *path)
    tok = _policy_tokenizer(cfg)
    train = build_data(cfg, read_data(cfg), tok).train
    demos = read_demonstrations(cfg, tok, train, [])
    assert len(demos) == (2 if from_file else len(train))
    for ex in demos.examples:
        assert tok.decode(ex.prompt_ids).endswith("<|assistant|>" + MARK)


# ----------------------------------------------------------------------------- presets and checks


@pytest.mark.parametrize(
    "preset, hub_id", [("qwen3-0.6b", "Qwen/Qwen3-0.6B"), ("qwen3.5-0.8b", "Qwen/Qwen3.5-0.8B")]
)
def test_the_qwen3_presets_switch_thinking_off(preset, hub_id):
    """(tests/test_config.py composes and validates every shipped preset, these among them.)"""
    cfg = composed([f"model={preset}"])
    assert cfg.model.name_or_path == hub_id
    assert cfg.model.chat_template_kwargs == NO_THINKING
    assert validate(cfg) == []
    cfg = composed([f"model={preset}", "model.chat_template_kwargs.enable_thinking=true"])
    assert to_typed(cfg).model.chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize("key", ["tools", "add_generation_prompt", "tokenize", "messages", "conversation"])
def test_a_key_grpo_cli_sets_is_refused(key):
    problems = validate(
        composed(tiny(f"++model.chat_template_kwargs={{{key}: true, enable_thinking: false}}"))
    )
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert f"model.chat_template_kwargs.{key} is set" in problems[0]
    assert f"drop model.chat_template_kwargs.{key}" in problems[0]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"chat_template": "x"}, "set model.chat_template to the template instead"),
        ({"continue_final_message": True}, "an option of tokenizer.apply_chat_template"),
        (
            {"enable-thinking": False},
            "the key 'enable-thinking', which is not a name a Jinja template can read",
        ),
        ({"enable_thinking": object}, "holds <class 'object'> (type), which is not a plain YAML value"),
        ({"x": {"y": [1, {2: "z"}]}}, "holds the key 2 (int), which is not a plain YAML value"),
        (["enable_thinking"], "is not a mapping"),
    ],
)
def test_the_other_bad_kwargs_are_one_paragraph(kwargs, says):
    problems = check_template_kwargs(kwargs)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert says in problems[0]


def test_plain_kwargs_of_any_yaml_shape_pass():
    assert check_template_kwargs({}) == []
    assert (
        check_template_kwargs({"enable_thinking": False, "a": [1, 2.5, None, "s"], "b": {"c": [True]}}) == []
    )
    cfg = composed(tiny("++model.chat_template_kwargs={enable_thinking: false, reasoning_effort: low}"))
    assert validate(cfg) == []
