"""The judge reward (grpo_cli/rewards/judge.py) against a real HTTP server (grpo_cli/testing/judge_server.py):
parsing, templates, concurrency, retries, timeouts, failure policy, the API key, the build's
check that the server answers, and option checks. Fast: tiny latencies and timeouts."""

from __future__ import annotations

import math
import socket
import time

import pytest

from grpo_cli.rewards import RewardError, aio, build_rewards, check_rewards
from grpo_cli.rewards.judge import REWARD, build, check_options
from grpo_cli.testing.judge_server import Fault, JudgeServer, echo

KEY = "sk-test-0123456789abcdef"


@pytest.fixture
def server():
    with JudgeServer(reply=echo) as s:
        yield s


@pytest.fixture
def judges():
    """make(server, **options) -> a built judge (template "{completion}": the echo server replies
    the completion itself); every judge made is closed at the end."""
    made = []

    def make(srv: JudgeServer, **options):
        options = {"base_url": srv.url, "model": "judge", "template": "{completion}", **options}
        scorer = build(None, None, **options)
        made.append(scorer)
        return scorer

    yield make
    for scorer in made:
        REWARD.close(scorer)


def score(scorer, completions, **kwargs):
    return aio.run(scorer(completions, **kwargs))


def same(got, want):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w), (got, want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------
# parsing the judge's reply
# ----------------------------------------------------------------------------

NAN = math.nan
PARSE_CASES = [
    # (options, [(the judge's reply, the reward)]); on_error=nan: a reply that does not parse is NaN
    (
        {},
        [
            ("7", 0.7),
            ("10", 1.0),
            ("0", 0.0),
            ("Score: 8/10", 0.8),
            ("  7.5 - good", 0.75),
            ("11", NAN),  # outside [min_score, max_score]
            ("-1", NAN),
            ("great answer", NAN),  # no number
            ("", NAN),
        ],
    ),
    ({"min_score": 1, "max_score": 5}, [("1", 0.0), ("3", 0.5), ("5", 1.0), ("0", NAN), ("4.", 0.75)]),
    (
        {"parse": "yes_no"},
        [
            ("yes", 1.0),
            ("No", 0.0),
            ("  **Yes.** It is right", 1.0),
            ("NO, because", 0.0),
            ('"no"', 0.0),
            ("Not quite", NAN),
            ("maybe", NAN),
            ("The answer is yes", NAN),  # the first word decides
            ("1", NAN),
        ],
    ),
]


@pytest.mark.parametrize("options,cases", PARSE_CASES, ids=["number", "number-1-5", "yes_no"])
def test_replies_parse_into_rewards(server, judges, options, cases):
    judge = judges(server, on_error="nan", **options)
    replies = [reply for reply, _ in cases]
    same(score(judge, replies), [want for _, want in cases])
    failures = sum(math.isnan(want) for _, want in cases)
    assert judge.pop_metrics() == {"calls": len(cases), "retries": 0, "timeouts": 0, "failures": failures}
    assert judge.pop_metrics() == {"calls": 0, "retries": 0, "timeouts": 0, "failures": 0}  # reset


def test_a_reply_that_does_not_parse_raises_naming_the_reply(server, judges):
    judge = judges(server)
    with pytest.raises(
        RewardError, match=r"index 1 of 2: its reply does not parse as number .*'great answer'"
    ):
        score(judge, ["7", "great answer"])


# ----------------------------------------------------------------------------
# what the judge is sent
# ----------------------------------------------------------------------------


def test_the_template_reads_prompt_completion_and_a_data_column(server, judges):
    template = "Q: {prompt}\nGold: {answer}\nA: {completion}\nRate {min_score:g}-{max_score:g}."
    options = {"template": template, "system": "You grade answers.", "max_tokens": 4, "temperature": 0.5}
    assert REWARD.columns(options) == ["answer"]
    server.reply = lambda request: "9"
    judge = judges(server, **options)
    prompts = [
        "What is 2+2?",  # text
        [{"role": "system", "content": "Think."}, {"role": "user", "content": "What is 3+3?"}],  # chat
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "What is 1+1?"},
        ],
    ]
    completions = ["4", [{"role": "assistant", "content": "6"}], [{"role": "assistant", "content": "2"}]]
    same(score(judge, completions, prompts=prompts, answer=["4", "6", "2"], completion_ids=None), [0.9] * 3)
    sent = sorted(server.requests, key=lambda r: r["messages"][1]["content"])
    rendered = [
        "Q: What is 2+2?\nGold: 4\nA: 4\nRate 0-10.",
        "Q: What is 3+3?\nGold: 6\nA: 6\nRate 0-10.",  # the policy's system message left out
        "Q: user: Hi\nassistant: Hello\nuser: What is 1+1?\nGold: 2\nA: 2\nRate 0-10.",  # a conversation
    ]
    assert [r["messages"][1]["content"] for r in sent] == sorted(rendered)
    for request in sent:
        assert request["model"] == "judge"
        assert request["messages"][0] == {"role": "system", "content": "You grade answers."}
        assert (request["max_tokens"], request["temperature"]) == (4, 0.5)


def test_the_default_templates_and_their_columns(server, judges):
    assert REWARD.columns({}) == [] and REWARD.columns({"parse": "yes_no"}) == []
    server.reply = lambda request: "yes"
    judge = judges(server, template=None, parse="yes_no")
    assert score(judge, ["4"], prompts=["2+2?"]) == [1.0]
    (request,) = server.requests
    assert request["messages"] == [{"role": "user", "content": request["messages"][0]["content"]}]
    assert "2+2?" in request["messages"][0]["content"] and "yes or no" in request["messages"][0]["content"]


def test_a_missing_column_or_prompts_is_named(server, judges):
    judge = judges(server, template="{completion} vs {answer}")
    with pytest.raises(
        RewardError, match=r"uses \{answer\}, but no dataset column 'answer'.*present: solution"
    ):
        score(judge, ["7"], solution=["7"])
    judge = judges(server, template="{prompt}: {completion}")
    with pytest.raises(RewardError, match=r"uses \{prompt\}, but no prompts were passed"):
        score(judge, ["7"])
    assert server.count == 0


# ----------------------------------------------------------------------------
# concurrency
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_at_most_concurrency_calls_are_in_flight(judges, concurrency):
    with JudgeServer(reply=echo, latency_s=0.05) as srv:
        judge = judges(srv, concurrency=concurrency)
        same(score(judge, ["5"] * 12), [0.5] * 12)
        assert srv.count == 12
        assert srv.max_in_flight == concurrency


def test_concurrency_8_is_much_faster_than_1(judges):
    with JudgeServer(reply=echo, latency_s=0.1) as srv:
        times = {}
        for concurrency in (1, 8):
            judge = judges(srv, concurrency=concurrency)
            score(judge, ["1"])  # connect first: time the calls, not the connection
            tick = time.perf_counter()
            same(score(judge, ["5"] * 8), [0.5] * 8)
            times[concurrency] = time.perf_counter() - tick
    assert times[1] >= 0.8
    assert times[1] > 4 * times[8], times


def test_the_client_is_reused_across_calls(server, judges):
    judge = judges(server)
    score(judge, ["1"])
    client = judge._client
    score(judge, ["2", "3"])
    assert judge._client is client


# ----------------------------------------------------------------------------
# retries, timeouts and the failure policy
# ----------------------------------------------------------------------------

RETRY_CASES = [
    # (server faults before it answers, retries, the reward, metrics)
    (["429", "429"], 3, 0.7, {"calls": 1, "retries": 2, "timeouts": 0, "failures": 0}),
    (["500", "500", "500"], 3, 0.7, {"calls": 1, "retries": 3, "timeouts": 0, "failures": 0}),
    (["429", "500"], 2, 0.7, {"calls": 1, "retries": 2, "timeouts": 0, "failures": 0}),
    (["500", "500", "500"], 2, NAN, {"calls": 1, "retries": 2, "timeouts": 0, "failures": 1}),
    (["500"], 0, NAN, {"calls": 1, "retries": 0, "timeouts": 0, "failures": 1}),
    (["hang", "500"], 2, 0.7, {"calls": 1, "retries": 2, "timeouts": 1, "failures": 0}),
]


@pytest.mark.parametrize("plan,retries,want,metrics", RETRY_CASES)
def test_429_5xx_and_timeouts_are_retried(judges, plan, retries, want, metrics):
    with JudgeServer(reply=echo, plan=plan) as srv:
        judge = judges(srv, retries=retries, backoff_s=0.01, timeout_s=0.3, on_error="nan")
        same(score(judge, ["7"]), [want])
        assert judge.pop_metrics() == metrics
        assert srv.count == min(len(plan), retries) + 1


def test_backoff_doubles_and_retry_after_is_honoured(judges):
    with JudgeServer(reply=echo, fail_500=2) as srv:
        judge = judges(srv, backoff_s=0.1)
        tick = time.perf_counter()
        assert score(judge, ["7"]) == [0.7]
        assert time.perf_counter() - tick >= 0.1 + 0.2  # 0.1 s, then 0.2 s
    with JudgeServer(reply=echo, fail_429=1, retry_after="0.4") as srv:
        judge = judges(srv, backoff_s=0.0)
        tick = time.perf_counter()
        assert score(judge, ["7"]) == [0.7]
        assert time.perf_counter() - tick >= 0.4


def test_a_timeout_under_on_error_nan_is_nan_and_counted(server, judges):
    judge = judges(server, timeout_s=0.2, retries=1, backoff_s=0.01, on_error="nan")
    tick = time.perf_counter()
    same(score(judge, ["7", "fault:hang", "3"]), [0.7, NAN, 0.3])
    assert time.perf_counter() - tick < 1.5
    assert judge.pop_metrics() == {"calls": 3, "retries": 1, "timeouts": 2, "failures": 1}


def test_a_timeout_under_on_error_raise_says_what_to_do(server, judges):
    judge = judges(server, timeout_s=0.2, retries=0)
    with pytest.raises(RewardError) as info:
        score(judge, ["7", "fault:hang", "3"])
    message = str(info.value)
    assert "\n" not in message  # one paragraph
    for part in (
        f"the judge at {server.url}/chat/completions (model 'judge')",
        "completion index 1 of 3",
        "no reply within timeout_s=0.2 s",
        "raise reward.judge.timeout_s",
        "reward.judge.on_error=nan",
    ):
        assert part in message, (part, message)
    assert judge.pop_metrics()["failures"] == 1


GARBAGE_CASES = [
    # (what the server does, the failure named in the error)
    ("fault:not_json", "the reply is not JSON: '<html>Bad Gateway</html>'"),
    ("fault:no_choices", "the reply has no choices[0].message.content"),
    ("fault:500", 'HTTP 500 (body: \'{"error": {"message": "internal error"}}\') after 1 retries'),
    ("fault:429", "HTTP 429"),
    ("x" * 300, "its reply does not parse as number (it has no number): '" + "x" * 100 + "'..."),
]


@pytest.mark.parametrize("completion,failure", GARBAGE_CASES, ids=[c[:16] for c, _ in GARBAGE_CASES])
def test_garbage_replies_fail_clearly(server, judges, completion, failure):
    judge = judges(server, retries=1, backoff_s=0.01)
    with pytest.raises(RewardError) as info:
        score(judge, [completion])
    assert failure in str(info.value)
    judge = judges(server, retries=1, backoff_s=0.01, on_error="nan")
    same(score(judge, ["7", completion]), [0.7, NAN])


def test_a_client_error_is_not_retried(server, judges):
    judge = judges(server, retries=3)
    with pytest.raises(RewardError, match=r"HTTP 404 \(body: .*The model does not exist.*\); check base_url"):
        score(judge, ["fault:404"])
    assert judge.pop_metrics()["retries"] == 0 and server.count == 1


# ----------------------------------------------------------------------------
# the API key
# ----------------------------------------------------------------------------


def test_the_api_key_is_sent_and_never_shown(server, judges, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    server.reply = lambda request: f"key {KEY} is not a score"
    judge = judges(server, api_key_env="JUDGE_TEST_KEY", retries=0)
    with pytest.raises(RewardError) as info:
        score(judge, ["7", "8"])
    assert set(server.auth_headers) == {f"Bearer {KEY}"}
    assert KEY not in str(info.value) and "***" in str(info.value)
    assert KEY not in repr(judge) and KEY not in str(judge.options)


@pytest.mark.parametrize("value", [None, ""])
def test_an_api_key_variable_that_is_unset_fails_at_build(server, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    else:
        monkeypatch.setenv("JUDGE_TEST_KEY", value)
    with pytest.raises(
        RewardError, match=r"'JUDGE_TEST_KEY', which is (not set|empty); export JUDGE_TEST_KEY="
    ):
        build(None, None, base_url=server.url, model="judge", api_key_env="JUDGE_TEST_KEY")
    assert server.probes == 0


# ----------------------------------------------------------------------------
# the build's check that the server answers
# ----------------------------------------------------------------------------


def test_a_server_that_answers_any_status_passes_the_build(server, judges):
    judges(server)
    assert server.probes == 1
    # A server without GET /models (404 there) still answers.
    judges(server, base_url=server.url + "/elsewhere")


def test_a_url_that_does_not_answer_fails_at_build():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RewardError) as info:
        build(None, None, base_url=url, model="judge")
    message = str(info.value)
    assert f"the judge at {url} does not answer" in message
    assert "start the server or fix reward.judge.base_url" in message


def test_a_server_that_never_replies_fails_at_build_after_its_timeout():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog), never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        tick = time.perf_counter()
        with pytest.raises(RewardError, match=r"does not answer \(GET .*/models: no reply within 0.2 s\)"):
            build(None, None, base_url=url, model="judge", timeout_s=0.2)
        assert time.perf_counter() - tick < 2


# ----------------------------------------------------------------------------
# option checks
# ----------------------------------------------------------------------------

GOOD = {"base_url": "http://127.0.0.1:8000/v1", "model": "judge"}
CHECK_CASES = [
    ({}, ["option base_url is required", "option model is required"]),
    ({**GOOD, "base_url": "127.0.0.1:8000/v1"}, ["base_url must be an http:// or https:// URL"]),
    ({**GOOD, "base_url": "ftp://host/v1"}, ["base_url must be an http:// or https:// URL"]),
    ({**GOOD, "model": ""}, ["model must be a non-empty string"]),
    ({**GOOD, "concurrency": 0}, ["concurrency must be >= 1"]),
    ({**GOOD, "concurrency": -2}, ["concurrency must be >= 1"]),
    ({**GOOD, "concurrency": 2.5}, ["concurrency must be an integer"]),
    ({**GOOD, "retries": -1}, ["retries must be >= 0"]),
    ({**GOOD, "timeout_s": 0}, ["timeout_s must be > 0"]),
    ({**GOOD, "timeout_s": -1}, ["timeout_s must be > 0"]),
    ({**GOOD, "backoff_s": -0.5}, ["backoff_s must be >= 0"]),
    ({**GOOD, "min_score": 10, "max_score": 10}, ["min_score (10) must be less than max_score (10)"]),
    ({**GOOD, "min_score": 5, "max_score": 1}, ["min_score (5) must be less than max_score (1)"]),
    ({**GOOD, "parse": "score"}, ["option parse must be one of 'number', 'yes_no'"]),
    ({**GOOD, "on_error": "skip"}, ["option on_error must be one of 'raise', 'nan'"]),
    ({**GOOD, "timeout": 5}, ["unknown option 'timeout' (did you mean 'timeout_s'?)"]),
    ({**GOOD, "template": "{completion"}, ["template is not a valid str.format template"]),
    ({**GOOD, "template": "{} {completion}"}, ["the field {} is positional"]),
    ({**GOOD, "template": "{answer:d}"}, ["template is not a valid str.format template"]),
    ({**GOOD, "template": "{model}: {completion}"}, ["template uses {model}, the name of a judge option"]),
    ({**GOOD, "template": ""}, ["template must be a non-empty string"]),
    ({**GOOD, "api_key_env": ""}, ["api_key_env must be the name of an environment variable"]),
    ({**GOOD, "max_tokens": 0}, ["max_tokens must be >= 1"]),
    ({**GOOD, "temperature": -1}, ["temperature must be >= 0"]),
    (  # all at once
        {"base_url": "x", "concurrency": 0, "retries": -1, "min_score": 3, "max_score": 2, "on_error": "?"},
        ["base_url must be", "model is required", "concurrency", "retries", "min_score (3)", "on_error"],
    ),
    (GOOD, []),
    ({**GOOD, "template": "{{literal}} {prompt} {answer[0]} {completion!r:>5}", "parse": "yes_no"}, []),
]


@pytest.mark.parametrize("options,problems", CHECK_CASES, ids=[str(i) for i in range(len(CHECK_CASES))])
def test_check_options(options, problems):
    found = check_options(options)
    assert len(found) == len(problems), found
    for want in problems:
        assert want in "\n".join(found), (want, found)
    # the same problems through the reward config, named by their node
    assert check_rewards({"judge": options}) == [f"reward.judge: {p}" for p in found]


def test_build_rejects_bad_options_too(server):
    with pytest.raises(RewardError, match="judge: option concurrency must be >= 1"):
        build(None, None, base_url=server.url, model="judge", concurrency=0)


# ----------------------------------------------------------------------------
# through the reward config and the engine's scoring
# ----------------------------------------------------------------------------


def test_build_rewards_open_score_and_close(server):
    rewards = build_rewards({"judge": {"base_url": server.url, "model": "judge", "template": "{completion}"}})
    (spec,) = rewards
    assert spec.reward is REWARD and spec.reward.nan_ok and spec.role == "shaping"
    with rewards.open("cpu"):
        judge = spec.fn
        assert aio.run(judge(["7", "2"], prompts=["a", "b"], **spec.options)) == [0.7, 0.2]
        assert judge._client is not None
    assert spec.scorer is None and judge._client is None  # closed
    judge.close()  # again: a no-op


def test_close_is_safe_when_nothing_was_sent(server):
    with build_rewards({"judge": {"base_url": server.url, "model": "judge"}}).open("cpu") as rewards:
        assert rewards[0].fn._client is None
    assert server.count == 0


def test_score_rewards_awaits_the_judge_and_keeps_its_nans(server):
    """The engine's scoring (rewards/scoring.py) with the judge: its awaitable is awaited, a NaN
    (on_error=nan) makes that completion's total NaN, and its counters come with the stats."""
    from grpo_cli.rewards import score_rewards

    node = {
        "base_url": server.url,
        "model": "judge",
        "template": "{completion} ({answer})",
        "on_error": "nan",
    }
    server.reply = lambda request: Fault("500") if "fault" in request["messages"][0]["content"] else "8"
    with build_rewards({"judge": {**node, "retries": 0}}).open("cpu") as rewards:
        stats: dict = {}
        totals, per_reward = score_rewards(
            list(rewards),
            ["good", "fault"],
            prompts=["p", "q"],
            completion_ids=None,
            columns={"answer": ["a", "b"]},
            stats=stats,
        )
    same(totals, [0.8, NAN])
    same(per_reward["judge"], [0.8, NAN])
    assert stats["rewards/judge/failures"] == 1
    assert stats["rewards/judge/calls"] == 2
