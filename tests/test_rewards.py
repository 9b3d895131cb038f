"""Tests for grpo_cli.rewards: built-in rewards (adversarially, ref 004 reward
hacking), config resolution, weighted scoring, the None rule and every
failure message."""

from __future__ import annotations

import math
import textwrap
import threading

import pytest

from grpo_cli.rewards import (
    REGISTRY,
    RewardError,
    RewardSpec,
    build_rewards,
    check_rewards,
    completion_text,
    resolve_reward,
    reward_metrics,
    score_rewards,
)
from grpo_cli.rewards.accuracy import accuracy
from grpo_cli.rewards.format import format_reward
from grpo_cli.rewards.length import length


def chat(text):
    return [{"role": "assistant", "content": text}]


# ----------------------------------------------------------------------------
# completion_text
# ----------------------------------------------------------------------------

TEXT_CASES = [
    ("47", "47"),  # plain string
    (chat("47"), "47"),  # TRL conversational completion
    ({"role": "assistant", "content": "47"}, "47"),  # a single message
    (
        [{"role": "assistant", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "7"}]}],
        "47",
    ),  # multimodal parts
    (
        [
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "x"},
            {"role": "assistant", "content": "b"},
        ],
        "a\nb",
    ),  # only assistant turns
    (None, ""),  # nothing generated
]


@pytest.mark.parametrize(
    "completion,expected", TEXT_CASES, ids=["str", "chat", "message", "parts", "assistant-only", "none"]
)
def test_completion_text(completion, expected):
    assert completion_text(completion) == expected


def test_completion_text_rejects_unknown_types():
    with pytest.raises(RewardError, match="unsupported completion type int"):
        completion_text(47)


# ----------------------------------------------------------------------------
# accuracy
# ----------------------------------------------------------------------------

# (completion, gold, options, expected)
ACCURACY_CASES = [
    # --- plain answers
    ("47", "47", {}, 1.0),  # bare number
    ("The answer is 47.", "47", {}, 1.0),  # sentence with trailing period
    ("47.0", "47", {}, 1.0),  # decimal equal to an integer
    ("1,234", "1234", {}, 1.0),  # thousands separator in the completion
    ("1234", "1,234", {}, 1.0),  # thousands separator in the gold
    ("-5", "-5", {}, 1.0),  # negative matches negative
    ("x = -5", "-5", {}, 1.0),  # negative after '='
    ("3/4", "0.75", {}, 1.0),  # fraction vs decimal
    ("0.75", "\\frac{3}{4}", {}, 1.0),  # decimal vs LaTeX gold
    ("The answer is $\\frac{1}{2}$.", "0.5", {}, 1.0),  # LaTeX completion
    ("$2\\sqrt{3}$", "2\\sqrt{3}", {}, 1.0),  # symbolic LaTeX
    ("12 + 35 = 47", "47", {}, 1.0),  # operands 12, 35 are not candidates
    ("答案是47", "47", {}, 1.0),  # Chinese, no space before the number
    (chat("47"), "47", {}, 1.0),  # chat-message completion
    ("Natalia sold 48/2 = 24 clips.\nIn total 48+24 = 72.\n#### 72", "#### 72", {}, 1.0),  # gsm8k gold + CoT
    ("I need the answer. 48/2 = 24, 48 + 24 = 72. The answer is 72.", "72", {}, 1.0),  # CoT, then a statement
    # --- adversarial (ref 004 reward hacking)
    ("470", "47", {}, 0.0),  # gold hidden inside a longer number
    ("The answer is 470.", "47", {"extract": "last_number"}, 0.0),  # same, last_number mode
    ("-5", "5", {}, 0.0),  # sign matters
    ("5", "-5", {}, 0.0),  # sign matters the other way
    ("", "47", {}, 0.0),  # empty completion
    ("   \n", "47", {}, 0.0),  # whitespace only
    ("I don't know", "47", {}, 0.0),  # no number at all
    ("47 or 48", "48", {}, 0.0),  # two candidates: strict gives 0
    ("47 or 48", "48", {"strict": False}, 1.0),  # ... non-strict takes math-verify's pick
    ("The answer is 12. 13. 14", "12", {}, 0.0),  # appended numbers after the statement
    ("The answer is 12. 13. 14", "12", {"strict": False}, 1.0),  # math-verify alone picks 12: farmable
    ("The answer is 12. 13. 14", "14", {"extract": "last_number"}, 0.0),  # last number + appended guesses
    ("The answer is 12. 13. 14", "14", {"extract": "last_number", "strict": False}, 1.0),  # the classic hack
    ("47. So the answer is 47", "47", {}, 1.0),  # repeating the same answer is fine
    ("47, 47", "47", {}, 1.0),  # same value twice is fine
    ("answer: 47; answer: 48", "48", {}, 0.0),  # two answer statements
    ("47 or 48. That is my answer", "48", {}, 0.0),  # an anchor that states nothing
    ("The answer is 47. \\boxed{48}", "48", {}, 0.0),  # box disagrees with the statement
    ("The answer is 12 - 13 - 14", "14", {"extract": "last_number"}, 0.0),  # last number is an operand
    ("The answer is 47,48", "47", {}, 0.0),  # comma list is not 47
    ("Adding 12 and 35 gives 47", "47", {}, 0.0),  # no answer statement: every number counts (documented)
    ("Adding 12 and 35 gives 47", "47", {"strict": False}, 1.0),  # ... fine without strict
    ("13 - 1", "12", {}, 0.0),  # restating the question as an expression (seen in training)
    ("4 * 4", "16", {}, 0.0),  # same, times
    ("9 - 15", "-6", {}, 0.0),  # same, negative result
    ("13 - 1", "12", {"strict": False}, 1.0),  # ... which math-verify alone evaluates and accepts
    ("13 - 1 = 12", "12", {}, 1.0),  # a computation that then states the value is fine
    ("\\boxed{13-1}", "12", {"extract": "boxed"}, 0.0),  # a boxed computation is not a value
    ("<answer>9 - 15</answer>", "-6", {"extract": "answer_tag"}, 0.0),  # nor a tagged one
    ("<answer>-6</answer>", "-6", {"extract": "answer_tag"}, 1.0),  # a negative value is a value
    # --- boxed mode
    ("so $\\boxed{47}$", "47", {"extract": "boxed"}, 1.0),  # boxed answer
    ("\\boxed{\\frac{1}{2}}", "0.5", {"extract": "boxed"}, 1.0),  # boxed fraction
    ("The answer is 47", "47", {"extract": "boxed"}, 0.0),  # no box
    ("\\boxed{47} \\boxed{48}", "48", {"extract": "boxed"}, 0.0),  # two different boxes
    ("\\boxed{47} \\boxed{48}", "48", {"extract": "boxed", "strict": False}, 1.0),  # non-strict: last box
    ("\\boxed{47, 48}", "47", {"extract": "boxed"}, 0.0),  # a set is not a number
    # --- answer_tag mode
    ("<think>12+35=47</think><answer>47</answer>", "47", {"extract": "answer_tag"}, 1.0),  # reasoning ignored
    ("<answer>1,234</answer>", "#### 1234", {"extract": "answer_tag"}, 1.0),  # gsm8k gold in another mode
    ("<answer>47 or 48</answer>", "48", {"extract": "answer_tag"}, 0.0),  # hedging inside the tag
    ("<answer>47</answer><answer>48</answer>", "48", {"extract": "answer_tag"}, 0.0),  # two tags
    ("<answer>47", "47", {"extract": "answer_tag"}, 0.0),  # unclosed (truncated) tag
    # --- gsm8k mode
    ("48/2 = 24\n#### 72", "72", {"extract": "gsm8k"}, 1.0),  # answer after ####
    ("#### 72", "#### 72", {"extract": "gsm8k"}, 1.0),  # gsm8k gold
    ("#### 70\n#### 72", "72", {"extract": "gsm8k"}, 0.0),  # two different #### lines
    ("The answer is 72", "72", {"extract": "gsm8k"}, 0.0),  # no ####
    # --- last_number mode
    ("12 + 35 = 47", "47", {"extract": "last_number"}, 1.0),  # last number
    ("The total is -1,234.5", "-1234.5", {"extract": "last_number"}, 1.0),  # sign + separators + decimals
    ("10-5", "-5", {"extract": "last_number"}, 0.0),  # binary minus is not a sign
    ("answer 47 apples", "47", {"extract": "last_number"}, 1.0),  # units after the number
]


def _id(case):
    completion, gold, options, expected = case
    text = completion_text(completion).replace("\n", " ")[:28]
    kind = "" if isinstance(completion, str) else "chat"
    mode = f"{options.get('extract', 'auto')}{'' if options.get('strict', True) else '-lax'}"
    return f"{mode}:{kind}{text!r}={gold}->{expected:g}"


@pytest.mark.parametrize(
    "completion,gold,options,expected", ACCURACY_CASES, ids=[_id(c) for c in ACCURACY_CASES]
)
def test_accuracy(completion, gold, options, expected):
    assert accuracy([completion], answer=[gold], **options) == [expected]


def test_accuracy_batch_other_column_and_none_gold():
    # answer_column reads another dataset column; a None gold is "not applicable".
    rewards = accuracy(
        ["47", "12", "x"], solution=["47", "13", None], answer_column="solution", prompts=["p"] * 3
    )
    assert rewards == [1.0, 0.0, None]


def test_accuracy_missing_column_names_column_and_present_columns():
    with pytest.raises(RewardError) as err:
        accuracy(["47"], answer_column="solution", question=["q"], prompts=["p"], completion_ids=[[1]])
    assert "'solution'" in str(err.value) and "question" in str(err.value)


def test_accuracy_unparseable_gold_is_loud():
    with pytest.raises(RewardError, match="cannot parse the gold answer 'n/a'.*row 1"):
        accuracy(["47", "47"], answer=["47", "n/a"])


def test_accuracy_bad_option():
    with pytest.raises(RewardError, match="extract must be one of"):
        accuracy(["47"], answer=["47"], extract="first_number")


def test_accuracy_works_outside_main_thread():
    # math-verify's signal-based timeout only works in the main thread; ours turns it off elsewhere.
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", accuracy(["\\boxed{47}"], answer=["47"])))
    thread.start()
    thread.join()
    assert out["r"] == [1.0]


# ----------------------------------------------------------------------------
# format
# ----------------------------------------------------------------------------

ARTICLE = {"max_chars": 16, "require_number": True, "value": 0.2}  # ref 004's format rule
TAGS = {"required_tags": ["think", "answer"]}

# (completion, options, expected)
FORMAT_CASES = [
    ("47", ARTICLE, 0.2),  # short and holds a number
    ("  47\n", ARTICLE, 0.2),  # surrounding whitespace is stripped
    ("The answer is 47", ARTICLE, 0.2),  # exactly 16 characters
    ("The answer is 470", ARTICLE, 0.0),  # 17 characters: too long
    ("forty-seven", ARTICLE, 0.0),  # no digit
    ("", ARTICLE, 0.0),  # empty: min_chars defaults to 1
    (chat("47"), ARTICLE, 0.2),  # chat-message completion
    ("", {}, 0.0),  # no checks configured: only non-empty required
    ("anything", {}, 1.0),  # default value 1.0
    ("ab", {"min_chars": 3}, 0.0),  # too short
    ("47", {"pattern": r"-?\d+"}, 1.0),  # fullmatch (default)
    ("x 47", {"pattern": r"-?\d+"}, 0.0),  # fullmatch rejects extra text
    ("x 47", {"pattern": r"-?\d+", "pattern_mode": "search"}, 1.0),  # search finds it
    ("<think>a</think>\n<answer>47</answer>", TAGS, 1.0),  # tags in order
    ("<answer>47</answer><think>a</think>", TAGS, 0.0),  # wrong order
    ("<think>a</think>", TAGS, 0.0),  # missing answer tag
    ("<think>a</think><answer>4</answer><answer>7</answer>", TAGS, 0.0),  # repeated tag
    ("<think>a<answer>47</answer></think>", TAGS, 0.0),  # answer nested inside think
]


@pytest.mark.parametrize(
    "completion,options,expected",
    FORMAT_CASES,
    ids=[f"{completion_text(c)[:24]!r}-{'/'.join(o) or 'defaults'}" for c, o, _ in FORMAT_CASES],
)
def test_format(completion, options, expected):
    assert format_reward([completion], **options) == [pytest.approx(expected)]


@pytest.mark.parametrize(
    "options,message",
    [
        ({"pattern": "("}, "not a valid regex"),  # broken regex
        ({"pattern_mode": "match"}, "pattern_mode must be one of"),  # unknown mode
        ({"required_tags": "answer"}, "required_tags must be a non-empty list"),  # a string, not a list
        ({"required_tags": ["<answer>"]}, "is not a tag name"),  # brackets included
        ({"max_chars": 1, "min_chars": 2}, "nothing can pass"),  # impossible range
    ],
    ids=["regex", "mode", "tags-str", "tags-brackets", "range"],
)
def test_format_bad_options(options, message):
    with pytest.raises(RewardError, match=message):
        format_reward(["47"], **options)


# ----------------------------------------------------------------------------
# length
# ----------------------------------------------------------------------------

# (n, options, expected); the completion has n tokens and n characters.
LENGTH_CASES = [
    (20, {"target": 20}, 0.0),  # penalty: at target
    (30, {"target": 20}, -0.5),  # penalty: 50% over
    (10, {"target": 20, "scale": 2.0}, -1.0),  # penalty: scaled
    (60, {"target": 20}, -2.0),  # penalty: unbounded below
    (20, {"target": 20, "mode": "reward"}, 1.0),  # reward: at target
    (25, {"target": 20, "mode": "reward"}, 0.75),  # reward: linear
    (50, {"target": 20, "mode": "reward"}, 0.0),  # reward: floored at 0
    (96, {"mode": "dapo_overlong", "max_length": 128, "soft_cache": 32}, 0.0),  # DAPO: before the soft zone
    (112, {"mode": "dapo_overlong", "max_length": 128, "soft_cache": 32}, -0.5),  # DAPO: halfway
    (128, {"mode": "dapo_overlong", "max_length": 128, "soft_cache": 32}, -1.0),  # DAPO: at max_length
    (200, {"mode": "dapo_overlong", "max_length": 128, "soft_cache": 32}, -1.0),  # DAPO: beyond
    (129, {"mode": "dapo_overlong", "max_length": 128}, -1.0),  # DAPO: hard cut without soft_cache
    (
        112,
        {"target": 100, "mode": "reward", "max_length": 128, "soft_cache": 32},
        0.88 - 0.5,
    ),  # reward + overlong
]


@pytest.mark.parametrize(
    "n,options,expected",
    LENGTH_CASES,
    ids=[f"{o.get('mode', 'penalty')}-len{n}{'-scaled' if 'scale' in o else ''}" for n, o, _ in LENGTH_CASES],
)
@pytest.mark.parametrize("unit", ["tokens", "chars"])
def test_length(n, options, expected, unit):
    completion = chat("x" * n)
    out = length([completion], completion_ids=[list(range(n))], unit=unit, **options)
    assert out == [pytest.approx(expected)]


def test_length_units_differ():
    # ref 000.5: characters are not tokens.
    text, ids = "hello world", [101, 102]
    assert length([text], completion_ids=[ids], target=2, unit="tokens") == [0.0]
    assert length([text], completion_ids=[ids], target=2, unit="chars") == [pytest.approx(-4.5)]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"target": 20}, "needs completion_ids"),  # tokens without ids
        ({"target": 20, "unit": "words", "completion_ids": [[1]]}, "unit must be one of"),  # bad unit
        ({"completion_ids": [[1]]}, "target is required"),  # penalty without target
        ({"mode": "dapo_overlong", "completion_ids": [[1]]}, "max_length is required"),  # dapo without max
        (
            {"mode": "dapo_overlong", "max_length": 8, "soft_cache": 9, "completion_ids": [[1]]},
            "must not exceed",
        ),
        ({"target": 0, "completion_ids": [[1]]}, "target must be > 0"),  # division by zero
    ],
    ids=["no-ids", "unit", "no-target", "no-max", "cache>max", "zero-target"],
)
def test_length_errors(kwargs, message):
    with pytest.raises(RewardError, match=message):
        length(["x"], **kwargs)


# ----------------------------------------------------------------------------
# resolving and building
# ----------------------------------------------------------------------------

USER_MODULE = """
def bonus(completions, flag=1.0, **kwargs):
    return [float(flag)] * len(completions)

class Holder:
    @staticmethod
    def nested(completions, **kwargs):
        return [0.5] * len(completions)

NOT_CALLABLE = 3

def no_kwargs(completions):
    return [0.0] * len(completions)

def raises_on_bad(completions, **kwargs):
    out = []
    for c in completions:
        if "bad" in c:
            raise ValueError("cannot score this one")
        out.append(1.0)
    return out

def batch_only(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("batch too big")
    return [1.0]

def wrong_length(completions, **kwargs):
    return [1.0] * (len(completions) + 1)

def non_numeric(completions, **kwargs):
    return [1.0, "0.5"][: len(completions)]

def nan_reward(completions, **kwargs):
    return [1.0, float("nan")][: len(completions)]

def not_a_list(completions, **kwargs):
    return 1.0

def none_reward(completions, **kwargs):
    return [None] * len(completions)

def echo_kwargs(completions, prompts, completion_ids, answer, offset=0.0, **kwargs):
    return [len(p) + len(ids) + float(a) + offset for p, ids, a in zip(prompts, completion_ids, answer)]
"""


@pytest.fixture
def user_mod(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "broken_dep.py").write_text("import not_installed_dependency_xyz\n")
    (tmp_path / "syntax_err.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_registry_is_derived_from_the_built_ins_declarations():
    from grpo_cli.rewards import accuracy as accuracy_module
    from grpo_cli.rewards import format as format_module
    from grpo_cli.rewards import length as length_module

    assert set(REGISTRY) == {"accuracy", "environment", "format", "judge", "length", "model", "reasoning_gym"}
    for name, module, fn in (
        ("accuracy", accuracy_module, accuracy),
        ("format", format_module, format_reward),
        ("length", length_module, length),
    ):
        declared = REGISTRY[name]
        assert declared is module.REWARD and declared.name == name and declared.fn is fn
        assert declared.options is module.Options and declared.check is module.check_options
        assert declared.role == module.ROLE
    assert REGISTRY["accuracy"].role == "correctness"


@pytest.mark.parametrize(
    "path",
    ["my_rewards:bonus", "my_rewards.bonus", "my_rewards:Holder.nested"],
    ids=["colon", "dot", "nested-attr"],
)
def test_resolve_import_path(user_mod, path):
    fn = resolve_reward("mine", path).fn
    assert callable(fn) and fn(["a"]) in ([1.0], [0.5])


def test_resolve_builtin():
    assert resolve_reward("length").fn is length


@pytest.mark.parametrize(
    "name,path,needles",
    [
        (
            "acuracy",
            None,
            [
                "unknown reward 'acuracy'",
                "accuracy, environment, format, judge, length, model",
                "Did you mean 'accuracy'",
                "reward.acuracy.fn=package.module:function",
            ],
        ),
        ("mine", "no_such_module_xyz:f", ["module 'no_such_module_xyz' was not found"]),
        ("mine", "broken_dep:f", ["exists but importing it failed", "not_installed_dependency_xyz"]),
        ("mine", "syntax_err:f", ["importing module 'syntax_err' raised SyntaxError"]),
        ("mine", "my_rewards:bonsu", ["has no attribute 'bonsu'", "Did you mean bonus"]),
        ("mine", "my_rewards:NOT_CALLABLE", ["resolves to a int, not a callable"]),
        ("mine", "my_rewards", ["not an import path"]),
        ("mine", "my rewards:f", ["not an import path"]),
    ],
    ids=[
        "unknown-name",
        "no-module",
        "missing-dependency",
        "syntax-error",
        "no-attribute",
        "not-callable",
        "no-function",
        "bad-chars",
    ],
)
def test_resolve_errors(user_mod, name, path, needles):
    with pytest.raises(RewardError) as err:
        resolve_reward(name, path)
    for needle in needles:
        assert needle in str(err.value)


def test_build_rewards_specs(user_mod):
    specs = build_rewards(
        {
            "accuracy": {"weight": 1.0, "extract": "boxed"},  # built-in with an option
            "format": {"weight": 0.5, "max_chars": 16, "require_number": True, "value": 0.2},
            "mine": {"fn": "my_rewards:bonus", "flag": 2},  # user function, default weight
        }
    )
    assert [(s.name, s.weight, s.options) for s in specs] == [
        ("accuracy", 1.0, {"extract": "boxed"}),
        ("format", 0.5, {"max_chars": 16, "require_number": True, "value": 0.2}),
        ("mine", 1.0, {"flag": 2}),
    ]
    assert specs[2].fn(["a"], **specs[2].options) == [2.0]


def test_build_rewards_reports_every_problem(user_mod):
    cfg = {
        "acuracy": {"weight": 1.0},  # unknown name
        "format": {"weight": "heavy", "max_char": 16},  # non-numeric weight + unknown option
        "length": None,  # built-in without its required target
        "mine": {"fn": "my_rewards:nope"},  # bad import path
        "strict_sig": {"fn": "my_rewards:no_kwargs"},  # user fn without **kwargs
        "clash": {"fn": "my_rewards:bonus", "prompts": 1},  # reserved option name
        "scalar": 0.5,  # not a mapping
    }
    problems = check_rewards(cfg)
    joined = "\n".join(problems)
    for needle in [
        "reward.acuracy: unknown reward 'acuracy'",
        "reward.format.weight must be a finite number, got 'heavy'",
        "reward.format: unknown option 'max_char' (did you mean 'max_chars'?)",
        "reward.length: option target is required",
        "reward.mine:",
        "has no attribute 'nope'",
        "reward.strict_sig: fn='my_rewards:no_kwargs': the function must accept **kwargs",
        "reward.clash: option name 'prompts' is reserved",
        "reward.scalar: expected a mapping",
    ]:
        assert needle in joined
    assert len(problems) == 8
    with pytest.raises(RewardError) as err:
        build_rewards(cfg)
    assert "8 problems" in str(err.value) and all(p in str(err.value) for p in problems)


def test_check_rewards_empty_and_ok():
    assert check_rewards({}) and "no reward functions configured" in check_rewards({})[0]
    assert check_rewards({"accuracy": {}, "format": {"value": 0.2, "max_chars": 16}}) == []


def test_build_rewards_accepts_omegaconf():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"format": {"weight": 2, "required_tags": ["think", "answer"]}})
    (spec,) = build_rewards(cfg)
    assert (
        spec.options == {"required_tags": ["think", "answer"]} and type(spec.options["required_tags"]) is list
    )
    assert spec.weight == 2.0


# ----------------------------------------------------------------------------
# scoring
# ----------------------------------------------------------------------------


def _score(specs, completions, **columns):
    n = len(completions)
    return score_rewards(
        specs, completions, prompts=[f"p{i}" for i in range(n)], completion_ids=[[1, 2]] * n, columns=columns
    )


def test_score_weighted_totals_and_columns(user_mod):
    specs = build_rewards(
        {
            "accuracy": {"weight": 1.0},
            "format": {"weight": 0.5, "max_chars": 16, "require_number": True, "value": 0.2},
            "mine": {"fn": "my_rewards.bonus", "weight": -2.0, "flag": 0.25},
        }
    )
    completions = ["47", chat("The answer is 12. 13. 14"), "a long answer without any digits"]
    totals, per_reward = _score(specs, completions, answer=["47", "12", "5"])
    assert per_reward["accuracy"] == [1.0, 0.0, 0.0]
    assert per_reward["format"] == [0.2, 0.0, 0.0]
    assert per_reward["mine"] == [0.25] * 3
    assert totals == pytest.approx([1.0 + 0.1 - 0.5, -0.5, -0.5])


def test_score_passes_columns_prompts_ids_and_options(user_mod):
    (spec,) = build_rewards({"echo": {"fn": "my_rewards:echo_kwargs", "offset": 0.5}})
    totals, per_reward = score_rewards(
        [spec],
        ["a", "b"],
        prompts=["abc", "x"],
        completion_ids=[[1], [1, 2, 3]],
        columns={"answer": ["10", "20"]},
    )
    assert per_reward["echo"] == [3 + 1 + 10 + 0.5, 1 + 3 + 20 + 0.5]


def test_none_rule(user_mod):
    # accuracy is None where the gold is None; that sample's total is format's value only,
    # and the None is excluded from accuracy's metrics.
    specs = build_rewards({"accuracy": {"weight": 1.0}, "format": {"weight": 1.0, "value": 0.5}})
    totals, per_reward = _score(specs, ["47", "47", "48"], answer=["47", None, "47"])
    assert per_reward["accuracy"] == [1.0, None, 0.0]
    assert totals == [1.5, 0.5, 0.5]
    metrics = reward_metrics(per_reward)
    assert (
        metrics["rewards/accuracy/mean"] == 0.5 and metrics["rewards/accuracy/std"] == 0.5
    )  # population std
    assert metrics["rewards/format/mean"] == 0.5 and metrics["rewards/format/std"] == 0.0


def test_metrics_all_none_is_nan():
    metrics = reward_metrics({"x": [None, None]})
    assert math.isnan(metrics["rewards/x/mean"]) and math.isnan(metrics["rewards/x/std"])


def _spec(path):
    return RewardSpec(name="mine", reward=resolve_reward("mine", path), weight=1.0, options={})


@pytest.mark.parametrize(
    "path,completions,needles",
    [
        (
            "my_rewards:raises_on_bad",
            ["ok", "ok", "a bad one"],
            [
                "reward 'mine' raised ValueError: cannot score this one",
                "index 2 of 3",
                "'a bad one'",
                "row: answer='c'",
            ],
        ),
        (
            "my_rewards:batch_only",
            ["a", "b"],
            ["reward 'mine' raised RuntimeError", "does not fail", "whole batch"],
        ),
        ("my_rewards:wrong_length", ["a", "b"], ["reward 'mine' returned 3 values for 2 completions"]),
        (
            "my_rewards:non_numeric",
            ["a", "b"],
            ["reward 'mine' returned a non-numeric value '0.5'", "index 1", "'b'"],
        ),
        ("my_rewards:nan_reward", ["a", "b"], ["reward 'mine' returned nan", "index 1", "'b'"]),
        ("my_rewards:not_a_list", ["a", "b"], ["reward 'mine' returned float 1.0", "must return a list"]),
        (
            "my_rewards:none_reward",
            ["a", "b"],
            ["every reward (mine) returned None for completion index 0", "'a'", "configuration bug"],
        ),
    ],
    ids=["raises", "batch-only", "wrong-length", "non-numeric", "nan", "not-a-list", "all-none"],
)
def test_score_failures(user_mod, path, completions, needles):
    answers = ["a", "b", "c"][: len(completions)]
    with pytest.raises(RewardError) as err:
        _score([_spec(path)], completions, answer=answers)
    for needle in needles:
        assert needle in str(err.value)


def test_score_failure_keeps_cause(user_mod):
    with pytest.raises(RewardError) as err:
        _score([_spec("my_rewards:raises_on_bad")], ["bad"], answer=["a"])
    assert isinstance(err.value.__cause__, ValueError)


def test_score_builtin_failure_names_reward():
    # accuracy with a missing column: loud, names the reward and the column.
    specs = build_rewards({"accuracy": {"answer_column": "solution"}})
    with pytest.raises(RewardError) as err:
        _score(specs, ["47", "48"], answer=["47", "48"])
    assert "reward 'accuracy' raised RewardError" in str(err.value) and "'solution'" in str(err.value)
    assert "fails on every completion" in str(err.value)


def test_score_inf_from_builtin_scale_is_caught(user_mod):
    spec = RewardSpec(
        name="huge",
        reward=REGISTRY["length"],
        weight=1.0,
        options={"target": 1, "unit": "chars", "scale": 1e308},
    )
    with pytest.raises(RewardError, match="reward 'huge' returned -inf"):
        _score([spec], ["x" * 100])


def test_score_column_length_mismatch():
    with pytest.raises(RewardError, match="'answer' has 1 values for 2 completions"):
        _score(build_rewards({"accuracy": {}}), ["47", "48"], answer=["47"])


def test_score_option_column_clash(user_mod):
    spec = RewardSpec(
        name="mine", reward=resolve_reward("mine", "my_rewards:bonus"), weight=1.0, options={"answer": 1}
    )
    with pytest.raises(RewardError, match="option.*answer.*same name as dataset column"):
        _score([spec], ["a"], answer=["1"])


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True], ids=["normal-end", "error"])
def test_a_declared_reward_is_built_on_the_device_and_closed_however_the_run_ends(
    tmp_path, fail, monkeypatch
):
    """A Reward at an import path with build/close (what a reward model needs): grpo-train builds
    it once, on the training device, with its YAML options, and closes it at the end of the run,
    also when the run ends in an error (the reward's own, re-raised with its name). (In this
    process, what grpo-train trains: an error raised here is one grpo-train reports and exits on.)"""
    from conftest import tiny, train_here

    log = tmp_path / "lifecycle.log"
    monkeypatch.setenv("GRPO_TEST_LIFECYCLE", str(log))
    args = tiny(
        "+reward.lifecycle.fn=reward_fixtures:LIFECYCLE",
        "+reward.lifecycle.bonus=0.5",
        *(["+reward.lifecycle.fail_after=2"] if fail else []),
        "trainer.max_steps=2",
        "trainer.eval_steps=0",
    )
    error = None
    try:
        train_here(args, tmp_path / "run")
    except Exception as exc:  # noqa: BLE001 - what grpo-train would report: checked below
        error = exc
    assert log.read_text().splitlines() == ["build device=cpu dist=Dist bonus=0.5", "close"], error
    if fail:
        assert (
            error is not None
            and "reward 'lifecycle' raised RuntimeError: scorer failed on purpose" in str(error)
        )
    else:
        assert error is None, error


def test_rewards_open_closes_what_it_built_when_a_build_fails():
    from grpo_cli.rewards import Reward

    events = []

    def ok(device, dist, **options):
        events.append("build ok")
        return lambda completions, **kw: [0.0] * len(completions)

    def broken(device, dist, **options):
        raise OSError("no such reward model")

    specs = build_rewards(
        {
            "a": {"fn": Reward("a", build=ok, close=lambda s: events.append("close ok"))},
            "b": {"fn": Reward("b", build=broken)},
        }
    )
    with pytest.raises(OSError, match="no such reward model"):
        specs.open("cpu")
    assert events == ["build ok", "close ok"]
    with pytest.raises(TypeError, match="exactly one of fn and build"):
        Reward("neither")
