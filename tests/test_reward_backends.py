"""Rewards beyond a Python function called in the training process: a reward model (reward=model),
async rewards (all of a step's on one loop, at once), rewards in worker processes, time limits on
every call, and NaN from a reward that could not score (its group left out of the loss)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import TESTS, console_script, grpo, run_cli, tiny, train_here

from grpo_cli.rewards import RewardError, build_rewards, score_rewards


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny reward model: the built-in tiny Llama's body with a one-label head (random, seeded),
    its character tokenizer and chat template."""
    from grpo_cli.models import build_tiny
    from grpo_cli.rewards.model import from_causal_lm

    return from_causal_lm(build_tiny(), tmp_path_factory.mktemp("rm") / "tiny-rm", seed=3)


def _score(cfg: dict, completions: list, prompts: list | None = None, stats=None, **columns):
    prompts = prompts or ["What is 5 + 7?"] * len(completions)
    with build_rewards(cfg).open("cpu") as specs:
        return score_rewards(
            specs,
            completions,
            prompts=prompts,
            completion_ids=None,
            columns={k: list(v) for k, v in columns.items()},
            stats=stats,
        )


COMPLETIONS = ["12", "The answer is 7.", "no", "a longer completion than the others, by far", "5", ""]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("chat", [False, True])
def test_the_reward_model_scores_batches_as_a_plain_forward_of_each_text(reward_model, batch_size, chat):
    """Batched (right padded) scores equal one-at-a-time scores and a plain transformers forward
    of the reward model's own chat-template rendering, fp32 to 1e-5; a chat prompt's messages and
    a message-list completion render as the same conversation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompt = [{"role": "user", "content": "What is 5 + 7?"}] if chat else "What is 5 + 7?"
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS] if chat else COMPLETIONS
    _, per = _score(
        {"model": {"name_or_path": str(reward_model), "batch_size": batch_size}},
        completions,
        prompts=[prompt] * len(completions),
    )
    plain = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tok = AutoTokenizer.from_pretrained(reward_model)
    expected = []
    for c in COMPLETIONS:
        messages = [{"role": "user", "content": "What is 5 + 7?"}, {"role": "assistant", "content": c}]
        ids = tok(
            tok.apply_chat_template(messages, tokenize=False), return_tensors="pt", add_special_tokens=False
        )
        with torch.no_grad():
            expected.append(plain(**ids).logits[0, 0].item())
    assert per["model"] == pytest.approx(expected, abs=1e-5)
    assert len(set(round(v, 6) for v in expected)) == len(expected)  # (the texts do score apart)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_reward_model_is_frozen_in_the_trainers_dtype_and_freed_at_the_end(
    reward_model, precision, dtype
):
    from grpo_cli.precision import Precision, resolve_precision

    try:
        trainer = resolve_precision(precision, torch.device("cpu"))
    except Exception:  # (a CPU without bf16 refuses trainer.precision=bf16)
        trainer = Precision("bf16", None, False, weights_dtype=torch.bfloat16)
    specs = build_rewards({"model": {"name_or_path": str(reward_model)}})
    with specs.open("cpu", dtype=trainer.frozen_dtype):
        scorer = specs[0].fn
        params = list(scorer.model.parameters())
        assert {p.dtype for p in params} == {dtype} and not any(p.requires_grad for p in params)
        assert not scorer.model.training
        assert all(isinstance(v, float) for v in scorer(["12"], prompts=["1+1"]))
    assert scorer.model is None and specs[0].scorer is None


def test_bad_reward_models_are_refused_with_the_fix(reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from grpo_cli.rewards import check_rewards

    assert any(
        "'/no/such/rm' is not an existing folder" in p
        for p in check_rewards({"model": {"name_or_path": "/no/such/rm"}})
    )
    assert any("name_or_path=None" in p for p in check_rewards({"model": {}}))
    from grpo_cli.models import build_tiny

    two = tmp_path / "two-labels"
    AutoModelForSequenceClassification.from_pretrained(build_tiny(), num_labels=2).save_pretrained(two)
    with pytest.raises(RewardError, match="with 2 labels; a reward model scores with one"):
        build_rewards({"model": {"name_or_path": str(two)}}).open("cpu")


def test_async_rewards_of_a_step_run_at_the_same_time():
    """Two async rewards that each wait for the other to have started: they finish only when the
    step awaits them together (one after the other, the first would time out)."""
    import reward_fixtures

    reward_fixtures._MET.clear()
    stats: dict = {}
    totals, per = _score(
        {
            "a": {"fn": "reward_fixtures:meets_b", "weight": 1.0},
            "b": {"fn": "reward_fixtures:meets_a", "weight": 2.0},
            "sync": {"fn": "reward_fixtures:digit_sum", "weight": 0.0},
        },
        ["1", "22"],
        stats=stats,
    )
    assert per == {"a": [1.0, 1.0], "b": [1.0, 1.0], "sync": [1.0, 4.0]} and totals == [3.0, 3.0]
    assert {"time/rewards/a", "time/rewards/b", "time/rewards/sync"} <= set(stats)
    assert stats["rewards/a/failures"] == 0


@pytest.mark.parametrize(
    "node, needle",
    [
        ({"fn": "reward_fixtures:hangs", "call_timeout_s": 0.5}, "took longer than call_timeout_s=0.5 s"),
        ({"fn": "reward_fixtures:hangs_async", "call_timeout_s": 0.5}, "did not return in time"),
        (
            {"fn": "reward_fixtures:stuck_on_seven", "workers": 2, "call_timeout_s": 2},
            "completion index 1",
        ),
    ],
    ids=["sync", "async", "workers"],
)
def test_a_reward_that_hangs_ends_in_one_paragraph_naming_it(node, needle):
    tick = time.perf_counter()
    with pytest.raises(RewardError) as err:
        _score({"stuck": node}, ["12", "17", "3"])
    message = str(err.value)
    assert "reward 'stuck' did not return in time" in message and needle in message
    assert "reward.stuck.call_timeout_s" in message
    assert time.perf_counter() - tick < 60


def test_rewards_in_worker_processes_score_as_in_the_training_process():
    completions = [f"{i} and {i * 7}" for i in range(9)]
    _, here = _score({"d": {"fn": "reward_fixtures:digit_sum"}}, completions)
    _, pooled = _score({"d": {"fn": "reward_fixtures:digit_sum", "workers": 2}}, completions)
    assert pooled == here and len(set(here["d"])) > 3


@pytest.mark.parametrize(
    "node, needle",
    [
        ({"fn": "reward_fixtures:digit_sum", "workers": -1}, "workers=-1: give a whole number >= 0"),
        ({"fn": "reward_fixtures:async_chars", "workers": 2}, "this reward is async"),
        ({"fn": "reward_fixtures:digit_sum", "call_timeout_s": 0}, "call_timeout_s=0: give a number"),
        ({"name_or_path": "x", "workers": 1}, "built when the run starts"),
    ],
)
def test_bad_call_settings_are_config_problems(node, needle):
    from grpo_cli.rewards import check_rewards

    name = "model" if "name_or_path" in node else "r"
    assert any(needle in p for p in check_rewards({name: node})), check_rewards({name: node})


def test_nan_is_an_error_unless_the_reward_may_fail_then_it_counts():
    with pytest.raises(RewardError, match="returned nan"):
        _score({"n": {"fn": "reward_fixtures:nan_on_seven"}}, ["1", "7"])
    stats: dict = {}
    totals, per = _score({"n": {"fn": "reward_fixtures:MAY_FAIL"}}, ["1", "7"], stats=stats)
    assert per["n"][0] == 1.0 and totals[0] == 1.0 and all(v != v for v in (per["n"][1], totals[1]))
    assert stats["rewards/n/failures"] == 1


def test_a_group_with_a_nan_reward_is_left_out_of_the_loss():
    """advantages(): the group holding a NaN total gets advantages 0 and no trained token; the
    other groups' advantages are what they would be without it."""
    from conftest import scored_rows

    from grpo_cli.config.schema import LossConfig
    from grpo_cli.rollout import single_turn
    from grpo_cli.step import advantages

    G, C = 2, 3
    ones = torch.ones(6, C, dtype=torch.long)
    rollout = single_turn(
        G, torch.ones(6, 2, dtype=torch.long), torch.ones(6, 2, dtype=torch.long), ones, ones,
        torch.zeros(6, dtype=torch.bool), torch.zeros(6, C),
    )  # fmt: skip
    rewards = scored_rows(rollout, [1.0, 0.0, float("nan"), 1.0, 0.0, 1.0])
    batch, (sequences, tokens), signal = advantages(rewards, LossConfig(), "cpu")
    assert batch.advantages[2:4].tolist() == [0.0, 0.0] and batch.loss_mask[2:4].sum() == 0
    assert batch.zero_std[2:4].all() and signal
    clean_rows = scored_rows(rollout, [1.0, 0, 0, 0, 0, 1])
    clean, _, _ = advantages(clean_rows, LossConfig(), "cpu")
    assert batch.advantages[[0, 1, 4, 5]].tolist() == clean.advantages[[0, 1, 4, 5]].tolist()
    assert tokens == 4 * C and sequences == 4


def test_grpo_train_with_a_reward_model_and_an_async_reward(tmp_path, reward_model):
    """A tiny run scored by a reward model and an async function: it trains (the weights move),
    logs each reward's time and the model's scores, and scores the same on two processes. (The one
    process run trains here, as grpo-train would; the two-process one needs its processes.)"""
    from safetensors.torch import load_file

    from grpo_cli.models import build_tiny

    base = tiny(
        "reward=model",
        f"reward.model.name_or_path={reward_model}",
        "+reward.chars.fn=reward_fixtures:async_chars",
        "+reward.chars.weight=0.1",
        "loss.beta=0.04",
        "trainer.prompts_per_step=2",
        "trainer.max_steps=2",
        "trainer.eval_before=false",
        "data.eval_size=0",
    )
    runs = {"one": tmp_path / "one", "two": tmp_path / "two"}
    train_here(base, runs["one"])  # (a failure raises)
    res = grpo([*base, "trainer.num_processes=2", f"hydra.run.dir={runs['two']}"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {
        name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for name, run in runs.items()
    }
    for row in rows["one"]:
        assert row["time/rewards/model"] > 0 and row["time/rewards/chars"] > 0
        assert row["rewards/model/std"] > 0 and row["rewards/failed_groups"] == 0
    keys = ("rewards/model/mean", "rewards/model/std", "rewards/chars/mean", "reward")
    for a, b in zip(rows["one"], rows["two"]):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], abs=1e-5)
    before = load_file(build_tiny() / "model.safetensors")
    after = load_file(next((runs["one"] / "checkpoints").glob("*/model.safetensors")))
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


def test_grpo_reward_test_scores_with_a_reward_model_and_an_async_function(tmp_path, reward_model):
    res = run_cli(
        [
            console_script("grpo-reward-test"),
            "reward=model",
            f"reward.model.name_or_path={reward_model}",
            "+reward.chars.fn=reward_fixtures:async_chars",
            "-c",
            "12",
            "-c",
            "The answer is 12.",
            "--prompt",
            "What is 5 + 7?",
        ],
        tmp_path,
        env={"PYTHONPATH": str(TESTS), "COLUMNS": "200"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "model (x1)" in res.stdout and "chars (x1)" in res.stdout
    assert "time: model " in res.stdout and "chars " in res.stdout


def test_the_memory_estimate_counts_the_reward_model(reward_model):
    from transformers import AutoModelForSequenceClassification

    from grpo_cli.cli.check_env import memory_estimate

    info = {"vram_gib": None, "ram_gib": 24.0, "cuda_available": False, "bf16_supported": False}
    without = memory_estimate("tiny", [], info)["methods"]["full"]
    with_rm = memory_estimate("tiny", ["reward=model", f"reward.model.name_or_path={reward_model}"], info)
    full = with_rm["methods"]["full"]
    params = AutoModelForSequenceClassification.from_pretrained(reward_model).num_parameters()
    assert without["reward_model"] == 0 and full["reward_model"] == 4 * params  # fp32 weights
    assert full["total"] >= without["total"] + full["reward_model"]


JUDGED = (
    "reward=[accuracy,judge]",
    "reward.judge.model=judge",
    "reward.judge.template='{completion}'",
    "reward.judge.on_error=nan",
    "reward.judge.retries=0",
    "trainer.prompts_per_step=2",
    "trainer.max_steps=2",
    "trainer.eval_before=false",
    "data.eval_size=0",
)


@pytest.mark.slow  # an end-to-end run (in this process)
def test_grpo_train_with_a_judge_that_fails_once_masks_that_group_and_counts_it(tmp_path):
    """A judge served by a real HTTP server (the test's own) in a training run: its first call
    gets a 500, which under on_error=nan masks that completion's group (rewards/failed_groups)
    and is counted; every completion is one call; the run trains on. (In this process, as
    grpo-train would train; a failure raises.)"""
    from grpo_cli.testing.judge_server import JudgeServer

    with JudgeServer(
        reply=lambda request: str(len(request["messages"][-1]["content"]) % 11), plan=["500"]
    ) as server:
        run = tmp_path / "run"
        train_here(tiny(*JUDGED, f"reward.judge.base_url={server.url}"), run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    assert [r["rewards/judge/calls"] for r in rows] == [8, 8] and server.count == 16
    assert [r["rewards/judge/failures"] for r in rows] == [1, 0]
    assert [r["rewards/failed_groups"] for r in rows] == [1, 0]
    assert all(r["time/rewards/judge"] > 0 and r["reward"] == r["reward"] for r in rows)


def test_a_judge_template_naming_a_column_the_data_lacks_stops_before_the_model_loads(tmp_path):
    res = grpo(
        tiny(
            *JUDGED,
            "reward.judge.base_url=http://127.0.0.1:9/v1",
            "reward.judge.template='{prompt} against {gold}'",
        ),
        tmp_path,
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "reward.judge reads the column 'gold'" in res.stderr and "Loading" not in res.stderr


def test_grpo_reward_test_scores_with_a_judge_and_counts_its_calls(tmp_path):
    from grpo_cli.testing.judge_server import JudgeServer

    with JudgeServer(reply=lambda request: "Score: 8", plan=["429"]) as server:
        res = run_cli(
            [
                console_script("grpo-reward-test"),
                "reward=judge",
                f"reward.judge.base_url={server.url}",
                "reward.judge.model=judge",
                "-c",
                "12",
                "-c",
                "13",
                "--prompt",
                "What is 5 + 7?",
            ],
            tmp_path,
            env={"COLUMNS": "200"},
        )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "judge (x1)" in res.stdout and "0.8 " in res.stdout
    assert "judge/calls 2" in res.stdout and "judge/retries 1" in res.stdout
