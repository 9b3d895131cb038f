"""Data loading: the arithmetic generator, local files, chat prompts, long prompts, streaming."""

from __future__ import annotations

import json
import re

import pytest

from grpo_cli.build import build_data, read_data
from grpo_cli.config import to_typed
from grpo_cli.config.schema import DataConfig
from grpo_cli.data import Formatting, PromptStream, build_prompts, read_rows
from grpo_cli.data.arithmetic import arithmetic_rows, arithmetic_wide_rows, wide_space
from grpo_cli.errors import UserError
from grpo_cli.models import load_tokenizer, resolve_source


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_source("builtin:tiny"))


def load(tok, **overrides):
    """read_rows then build_prompts, for a data section with `overrides` (and max_prompt_length, seed)."""
    kw = dict(eval_size=10, num_examples=50, max_operand=99, max_multiplier=12, operations=["+", "-", "*"])
    kw.update(overrides)
    seed, max_prompt_length = kw.pop("seed", 0), kw.pop("max_prompt_length", 256)
    d = DataConfig(**kw)
    rows = read_rows(d, seed)
    return build_prompts(
        rows, tok, Formatting.of(d, max_prompt_length), f"data ({d.source} {d.path or ''})".strip()
    )


def test_arithmetic_is_seeded_unique_and_eval_never_in_train():
    train, evals = arithmetic_rows(
        300, 50, max_operand=30, max_multiplier=12, operations=["+", "-", "*"], seed=3
    )
    again, _ = arithmetic_rows(300, 50, max_operand=30, max_multiplier=12, operations=["+", "-", "*"], seed=3)
    assert train == again and len(train) == 300 and len(evals) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    row = train[0]
    a, word, b = row["prompt"].split("?")[0].split()[2:5]
    expected = {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[word]
    assert row["answer"] == str(expected)


def _operands(row):
    a, word, b = row["prompt"].split("?")[0].split()[2:5]
    return int(a), word, int(b)


def test_every_arithmetic_row_names_its_operation():
    train, evals = arithmetic_rows(
        200, 50, max_operand=20, max_multiplier=10, operations=["+", "-", "*"], seed=1
    )
    for row in train + evals:
        assert row["operation"] == _operands(row)[1]
    assert {r["operation"] for r in evals} == {"plus", "minus", "times"}
    # `kind` (what held-out accuracy is broken down by): a subtraction below zero is its own kind.
    for r in evals:
        negative = r["operation"] == "minus" and int(r["answer"]) < 0
        assert r["kind"] == ("minus_negative" if negative else r["operation"])
    assert {r["kind"] for r in evals} == {"plus", "minus", "minus_negative", "times"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_held_out_set_lies_outside_the_training_range(seed):
    kw = dict(max_operand=20, max_multiplier=10, operations=["+", "-", "*"], seed=seed)
    train, evals = arithmetic_rows(800, 200, **kw)
    wide = arithmetic_wide_rows(200, wide_max_operand=50, **kw)
    assert wide == arithmetic_wide_rows(200, wide_max_operand=50, **kw)  # seeded
    assert len(wide) == len({r["prompt"] for r in wide}) == 200
    assert not {r["prompt"] for r in wide} & {r["prompt"] for r in train + evals}
    for row in wide:
        a, word, b = _operands(row)
        assert max(a, b) > 20 and a <= 50 and b <= 50, row
        if word == "times":
            assert 20 < a and b <= 10, row
        assert row["answer"] == str({"plus": a + b, "minus": a - b, "times": a * b}[word])
    assert {r["operation"] for r in wide} == {"plus", "minus", "times"}
    # Its own random stream: the training draw is the one it was without the wide set.
    assert arithmetic_rows(800, 200, **kw) == (train, evals)


def test_wide_held_out_set_sizes():
    kw = dict(max_operand=20, max_multiplier=10, operations=["*"], seed=0)
    assert wide_space(20, 50, 10, ["*"]) == 30 * 11
    assert len(arithmetic_wide_rows(330, wide_max_operand=50, **kw)) == 330  # every one of them
    with pytest.raises(UserError, match="wide_eval_max_operand"):
        arithmetic_wide_rows(331, wide_max_operand=50, **kw)
    assert arithmetic_wide_rows(10, wide_max_operand=20, **kw) == []  # 0 or not above: none


def test_arithmetic_rejects_impossible_requests():
    with pytest.raises(UserError, match="distinct"):
        arithmetic_rows(1000, 10, max_operand=3, max_multiplier=3, operations=["+"], seed=0)
    with pytest.raises(UserError, match="data.operations"):
        arithmetic_rows(10, 1, max_operand=9, max_multiplier=9, operations=["/"], seed=0)


def test_jsonl_with_chat_prompts_and_extra_columns(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "level": i % 3}
        for i in range(20)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = load(tok, source="file", path=str(path), eval_size=4)
    assert len(data.train) == 16 and len(data.eval) == 4
    ex = data.train[0]
    assert set(ex.columns) == {"answer", "level"}
    text = tok.decode(ex.prompt_ids)
    assert text.startswith("<|user|>q") and text.endswith("<|assistant|>")  # chat template applied


@pytest.mark.parametrize("suffix", ["csv", "parquet", "json"])
def test_other_local_formats(tok, tmp_path, suffix):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"What is {i}?", "answer": str(i)} for i in range(10)])
    path = tmp_path / f"d.{suffix}"
    {"csv": ds.to_csv, "parquet": ds.to_parquet, "json": ds.to_json}[suffix](str(path))
    data = load(tok, source="file", path=str(path), eval_size=2)
    assert len(data.train) + len(data.eval) == 10
    assert all("answer" in ex.columns for ex in data.train)


def test_malformed_jsonl_line_is_named(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(UserError, match="line 2"):
        load(tok, source="file", path=str(path))


def test_missing_file_and_missing_column(tok, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load(tok, source="file", path=str(tmp_path / "nope.jsonl"))
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n' * 6)
    with pytest.raises(UserError, match="prompt_column"):
        load(tok, source="file", path=str(path))


@pytest.mark.parametrize("rule", ["drop", "truncate_left", "error"])
def test_long_prompt_rules(tok, tmp_path, rule):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "x" * (5 if i % 2 else 200), "answer": "1"} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    if rule == "error":
        with pytest.raises(UserError, match="max_prompt_length"):
            load(tok, source="file", path=str(path), long_prompts=rule, max_prompt_length=50, eval_size=0)
        return
    data = load(tok, source="file", path=str(path), long_prompts=rule, max_prompt_length=50, eval_size=0)
    if rule == "drop":
        assert len(data.train) == 5 and data.dropped == 5
    else:
        assert len(data.train) == 10 and data.truncated == 5
        assert max(len(ex.prompt_ids) for ex in data.train) == 50


def test_all_prompts_too_long_is_a_clear_error(tok):
    with pytest.raises(UserError, match="every training prompt is longer"):
        load(tok, max_prompt_length=3)


def test_prompt_stream_epochs_and_exact_resume(tok):
    data = load(tok, num_examples=7, eval_size=0)
    stream = PromptStream(data.train, seed=1)
    first = [ex.prompt for ex in stream.take(10)]  # crosses into epoch 1
    assert stream.epoch == 1 and sorted(first[:7]) == sorted(ex.prompt for ex in data.train)
    state = stream.state()
    rest = [ex.prompt for ex in stream.take(5)]
    resumed = PromptStream(data.train, seed=1)
    resumed.load_state(state)
    assert [ex.prompt for ex in resumed.take(5)] == rest


def test_gsm8k_preset_on_a_local_file_in_the_same_format(compose, tmp_path):
    """The hub preset, pointed at a local file with gsm8k's columns, loads and scores unchanged."""
    from omegaconf import OmegaConf

    from grpo_cli.config import validate
    from grpo_cli.rewards import build_rewards, score_rewards

    rows = [
        {
            "question": f"Natalia sold {n} clips in April and half as many in May. How many in total?",
            "answer": f"Natalia sold {n}/2 = <<{n}/2={n // 2}>>{n // 2} clips in May.\n#### {n + n // 2}",
        }
        for n in range(2, 42, 2)
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = compose(
        [
            "data=gsm8k",
            "data.source=file",
            f"data.path={path}",
            "data.subset=null",  # a hub dataset's subset: a file has none (validation says so)
            "data.eval_split=null",
            "reward=[accuracy]",
        ]
    )
    assert validate(cfg) == []
    typed = to_typed(cfg)
    typed.sampler.max_prompt_length = 512
    data = build_data(typed, read_data(typed), load_tokenizer(resolve_source("builtin:tiny")))
    assert len(data.train) + len(data.eval) == 20
    ex = data.train[0]
    total = int(ex.columns["answer"].split("#### ")[1])
    specs = build_rewards(OmegaConf.to_container(cfg.reward))
    _, per = score_rewards(
        specs,
        [f"So the total is {total}. The answer is {total}.", "The answer is 1."],
        prompts=[ex.prompt] * 2,
        completion_ids=None,
        columns={"answer": [ex.columns["answer"]] * 2},
    )
    assert per["accuracy"] == [1.0, 0.0]


@pytest.mark.parametrize("clean_up,expected", [(True, "15. It's"), (False, "15 . It 's")])
def test_completions_decode_the_same_under_every_transformers_version(tok, clean_up, expected):
    """Decoding is explicit: the tokenizer's clean_up_tokenization_spaces setting is applied by
    grpo-cli (as transformers 4.x did; 5.x ignores it for BPE tokenizers), so the rewards see the
    same text whatever the installed version."""
    import torch

    from grpo_cli.rewards import decode_completions

    original = tok.clean_up_tokenization_spaces
    tok.clean_up_tokenization_spaces = clean_up
    try:
        ids = torch.tensor([tok("15 . It 's", add_special_tokens=False)["input_ids"]])
        assert decode_completions(tok, ids, torch.ones_like(ids)) == [expected]
    finally:
        tok.clean_up_tokenization_spaces = original


GROUP_BY_CASES = [  # (column, the held-out rows' columns, error text or None)
    ("kind", [{"answer": 1}], None),  # the default: data without it gets no breakdown, no error
    (None, [{"answer": 1}], None),
    ("level", [{"level": "easy"}, {"level": "hard"}], None),
    (
        "nosuch",
        [{"answer": 1}],
        "data.eval_group_by='nosuch' is not a column of the held-out rows (they have: answer)",
    ),
    ("id", [{"id": i} for i in range(21)], "has 21 different values"),
]


@pytest.mark.parametrize(
    "column,rows,error", GROUP_BY_CASES, ids=[str(c[0]) + "-" + str(c[2] is None) for c in GROUP_BY_CASES]
)
def test_eval_group_by_is_checked_against_the_held_out_rows(column, rows, error):
    from grpo_cli.data import Example
    from grpo_cli.evaluate import check_group_by

    examples = [Example(prompt="p", prompt_ids=[1], columns=c) for c in rows]
    if error is None:
        check_group_by(column, examples, default="kind")
    else:
        with pytest.raises(UserError, match=re.escape(error)):
            check_group_by(column, examples, default="kind")


# ----------------------------------------------------------------------------- several files mixed


def _mix_files(tmp_path):
    import json

    a = tmp_path / "adds.jsonl"
    b = tmp_path / "subs.jsonl"
    a.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) + "\n" for i in range(100)
        )
    )
    b.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} minus 1?", "answer": str(i - 1)}) + "\n" for i in range(50)
        )
    )
    return a, b


def test_a_mix_draws_sources_by_weight_and_holds_out_each(tmp_path):
    """Two files at weights 3 and 1: about three training rows in four from the first, every row
    tagged with its source's name, each source's own held-out rows never trained on, and the
    same rows for the same seed (the stream's position then resumes exactly)."""
    from types import SimpleNamespace

    from grpo_cli.data.mix import Options, rows

    a, b = _mix_files(tmp_path)
    d = SimpleNamespace(eval_size=20, path=None)
    options = Options(sources=[{"path": str(a), "weight": 3}, {"path": str(b), "name": "minus"}], size=400)
    train, held = rows(d, 7, options)
    share = sum(r["source"] == "adds" for r in train) / len(train)
    assert len(train) == 400 and 0.68 < share < 0.82
    assert {r["source"] for r in held} == {"adds", "minus"} and len(held) == 20
    held_prompts = {r["prompt"] for r in held}
    assert not held_prompts & {r["prompt"] for r in train}
    again, _ = rows(d, 7, options)
    other, _ = rows(d, 8, options)
    assert again == train and other != train


@pytest.mark.parametrize(
    "sources, message",
    [
        ([], "must be a non-empty list"),
        ([{"path": "a.jsonl", "weight": 0}], "weight=0 (a.jsonl) must be a number > 0"),
        ([{"weight": 2}], "has no path"),
        (["x/a.jsonl", "y/a.jsonl"], "the name(s) a stand for more than one source"),
        ([{"path": "a.jsonl", "ratio": 2}], "has ratio; its keys are path, weight and name"),
    ],
)
def test_bad_mix_sources_are_one_paragraph_each(sources, message):
    from types import SimpleNamespace

    from grpo_cli.data.mix import check

    problems = check(SimpleNamespace(options={"sources": sources}, path=None))
    assert any(message in p and "\n" not in p for p in problems), problems


@pytest.mark.slow  # an end-to-end run (in this process)
def test_grpo_train_reports_held_out_accuracy_per_source(tmp_path):
    import json

    from conftest import TINY_BASE, train_here

    a, b = _mix_files(tmp_path)
    args = [
        *(x for x in TINY_BASE if not x.startswith("data.")),
        "data=mix",
        f"data.options.sources=[{{path: '{a}', weight: 3}}, {{path: '{b}', name: minus}}]",
        "data.eval_size=8",
        "trainer.max_steps=1",
        "hydra.run.dir=run",
    ]
    train_here(args, tmp_path / "run")  # (what grpo-train trains, in this process; a failure raises)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/accuracy" in r][-1]
    assert "eval/accuracy/adds" in final and "eval/accuracy/minus" in final, sorted(final)


@pytest.mark.parametrize("source", ["arithmetic", "file"])
def test_the_validation_set_is_apart_from_training_and_held_out(tmp_path, source):
    """data.val_size: arithmetic draws problems it neither trains on nor holds out, leaving its
    training rows as they are without one; a file's validation rows are carved from its training
    rows. Either way no validation row is a training or held-out row."""
    from grpo_cli.data import validation_rows

    kw = dict(eval_size=10, num_examples=50, max_operand=99, max_multiplier=12, operations=["+", "-", "*"])
    if source == "file":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(60)))
        kw = dict(source="file", path=str(path), eval_size=10)
    d = DataConfig(**kw, val_size=8)
    train, held_out = read_rows(d, 0)
    kept, val = validation_rows(d, train, 0)
    assert len(val) == 8
    prompts = lambda rows: {r["prompt"] for r in rows}  # noqa: E731
    assert not prompts(val) & (prompts(kept) | prompts(held_out))
    if source == "arithmetic":
        assert kept == train == read_rows(DataConfig(**kw), 0)[0]  # the training rows unchanged
    else:
        assert len(kept) == len(train) - 8 and prompts(kept) | prompts(val) == prompts(train)


def test_a_validation_set_the_arithmetic_space_cannot_hold_is_refused():
    from grpo_cli.config.schema import DataConfig as D
    from grpo_cli.data import arithmetic

    d = D(num_examples=10, eval_size=5, val_size=20, max_operand=3, max_multiplier=2, operations=["+"])
    problems = arithmetic.check(d)
    assert any("data.num_examples + data.eval_size + data.val_size = 35 exceeds" in p for p in problems), (
        problems
    )
