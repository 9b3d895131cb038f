"""Evaluation that decides (grpo_cli/early.py): the rule on tables of evaluations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo_cli.early import Progress, decide


def _run(values, *, patience=None, target=None):
    """Feed one value per evaluation (steps 8, 16, ...); what each decided, and the state after."""
    progress, out = Progress(), []
    for i, value in enumerate(values):
        d = decide(progress, value, 8 * (i + 1), patience=patience, target=target)
        progress = d.progress
        out.append(("best" if d.improved else "-") + ("/stop" if d.stop else ""))
        if d.stop:
            break
    return out, progress


@pytest.mark.parametrize(
    "values, patience, target, said, best, best_step",
    [
        ([0.1, 0.2, 0.3], None, None, ["best", "best", "best"], 0.3, 24),  # no rule: never stops
        ([0.1, 0.3, 0.3, 0.2], 2, None, ["best", "best", "-", "-/stop"], 0.3, 16),  # a plateau counts
        ([0.1, 0.3, 0.2, 0.4, 0.3], 2, None, ["best", "best", "-", "best", "-"], 0.4, 32),  # reset
        ([0.1, 0.5, 0.9], None, 0.5, ["best", "best/stop"], 0.5, 16),  # the target reached (>=)
        ([0.1, None, 0.05], 1, None, ["best", "-", "-/stop"], 0.1, 8),  # a missing value: no count
        ([0.0, 0.0, 0.0], 1, None, ["best", "-/stop"], 0.0, 8),  # the first evaluation is a best
    ],
)
def test_the_rule(values, patience, target, said, best, best_step):
    out, progress = _run(values, patience=patience, target=target)
    assert out == said
    assert progress.best == best and progress.best_step == best_step
    assert progress.stopped_at == (8 * len(said) if said[-1].endswith("/stop") else 0)


def test_the_state_round_trips_and_starts_empty():
    p = decide(Progress(), 0.25, 8, patience=3, target=None, held_out=0.5).progress
    assert Progress.from_dict(p.as_dict()) == p and p.best_held_out == 0.5
    assert Progress.from_dict(None).best == -math.inf


# ----------------------------------------------------------------------------- the settings and real runs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.best_metric=eval/accuracy"], "must be a validation metric"),
        (["trainer.early_stopping_patience=2", "trainer.eval_steps=4"], "set data.val_size"),
        (["trainer.early_stopping_patience=2", "data.val_size=8"], "set trainer.eval_steps"),
        (["trainer.early_stopping_patience=0", "data.val_size=8", "trainer.eval_steps=4"], "must be >= 1"),
        (["data.val_size=-1"], "data.val_size=-1 must be >= 0"),
    ],
)
def test_the_settings_are_checked(compose, overrides, message):
    from grpo_cli.config import validate

    problems = validate(compose(["model=tiny", *overrides]))
    assert any(message in p for p in problems), problems


EARLY = [
    "model=tiny",
    "data.num_examples=64",
    "data.eval_size=8",
    "data.val_size=8",
    "sampler.num_generations=4",
    "sampler.max_new_tokens=6",
    "trainer.quiet=true",
    "trainer.precision=fp32",
    "trainer.eval_steps=1",
    "trainer.eval_before=false",
    "optimizer.lr_scheduler=constant",
]


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_a_plateau_stops_the_run_and_keeps_the_best(compose, tmp_path, capsys):
    """Rewards all alike: val/reward is the same at every evaluation, so the first is the best and
    patience 2 ends the run at step 3 (of 10), its checkpoint written there and checkpoints/best
    holding step 1's weights; the validation rows are never trained on; a resume has nothing to do."""
    from grpo_cli import checkpoint as ckpt
    from grpo_cli.cli.train import train_config
    from grpo_cli.summary import read_metrics

    overrides = EARLY + [
        "reward=[]",
        "+reward.same.fn=reward_fixtures:constant",
        "trainer.best_metric=val/reward",
        "trainer.early_stopping_patience=2",
        "trainer.max_steps=10",
        "trainer.save_steps=1",
        "trainer.keep_last=10",
    ]
    train_config(compose(overrides + ["trainer.quiet=false"]), tmp_path)
    said = capsys.readouterr()
    assert "early stopping at step 3" in said.err, said.err
    assert "best: step 1 (val/reward" in said.out, said.out
    rows = read_metrics(tmp_path)
    assert rows[-1]["step"] == 3 and all("val/reward" in r for r in rows if r["step"] > 0)
    best = tmp_path / "checkpoints" / "best"
    record = json.loads((best / "best.json").read_text())
    assert record == {"metric": "val/reward", "value": rows[1]["val/reward"], "step": 1}
    assert not (best / "optimizer.pt").exists() and (best / "config.yaml").exists()
    steps = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert steps[-1] == "step-000003" and "best" not in steps
    step1 = _weights(tmp_path / "checkpoints" / "step-000001")
    assert all(torch.equal(v, _weights(best)[k]) for k, v in step1.items())
    assert train_config(compose(overrides + ["trainer.resume=auto"]), tmp_path) == {}
    assert "early stopping ended it at step 3" in capsys.readouterr().err


def test_a_resume_mid_patience_stops_where_the_uninterrupted_run_does(compose, tmp_path):
    """Killed (here: ended by max_steps) two evaluations into the run, resumed with the longer run's
    max_steps: it stops at the uninterrupted run's step with its weights bit for bit, because the
    early-stopping state (best, evaluations since) is kept in the checkpoint. Rewards with signal,
    so the weights move; where it stops depends on the machine, what is compared does not."""
    from grpo_cli import checkpoint as ckpt
    from grpo_cli.cli.train import train_config

    common = EARLY + [
        "reward=[]",
        "+reward.code.fn=reward_fixtures:char_code",
        "trainer.best_metric=val/reward",
        "trainer.early_stopping_patience=2",
        "optimizer.learning_rate=1e-3",
        "trainer.save_steps=1",
        "trainer.keep_last=20",
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    train_config(compose(common + ["trainer.max_steps=12"]), whole)
    train_config(compose(common + ["trainer.max_steps=2"]), parts)
    train_config(compose(common + ["trainer.max_steps=12", "trainer.resume=auto"]), parts)
    last = [ckpt.list_checkpoints(run)[-1] for run in (whole, parts)]
    assert last[0].name == last[1].name
    a, b = (_weights(p) for p in last)
    assert all(torch.equal(a[k], b[k]) for k in a)
    states = [ckpt.load_training_state(p)[0] for p in last]
    states = [s if isinstance(s, ckpt.TrainerState) else ckpt.TrainerState.from_dict(s) for s in states]
    states = [s.early for s in states]
    assert states[0] == states[1]
    assert json.loads((whole / "checkpoints/best/best.json").read_text()) == json.loads(
        (parts / "checkpoints/best/best.json").read_text()
    )


def test_sampled_evaluation_reports_pass_at_k_and_leaves_training_alone(compose, tmp_path):
    """trainer.eval_samples=2: every evaluation also samples two completions a prompt (pass@1 <=
    pass@2, per set and per group), each prompt from its own seed, so the training's draws and
    weights are the same bit for bit as the run's without it."""
    from grpo_cli.cli.train import train_config
    from grpo_cli.summary import read_metrics

    common = EARLY + ["trainer.max_steps=2", "optimizer.learning_rate=1e-3"]
    runs = {}
    for k in (0, 2):
        run = tmp_path / str(k)
        run.mkdir()
        train_config(compose(common + [f"trainer.eval_samples={k}"]), run)
        runs[k] = read_metrics(run)
    sampled = [r for r in runs[2] if r["step"] > 0]
    for row in sampled:
        for prefix in ("eval", "val"):
            assert 0.0 <= row[f"{prefix}/pass@1"] <= row[f"{prefix}/pass@2"] <= 1.0, row
        assert any(k.startswith("eval/pass@2/") for k in row)
    assert not any("pass@" in k for r in runs[0] for k in r)
    for a, b in zip(runs[0], runs[2]):
        timing = ("step_time", "tokens_per_second")
        same = {k: v for k, v in a.items() if not k.startswith(("time/", "memory/")) and k not in timing}
        assert same == {k: b[k] for k in same}, (a, b)
    weights = [_weights(tmp_path / str(k) / "checkpoints" / "step-000002") for k in (0, 2)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.eval_temperature=0", "trainer.eval_samples=2"], "must be > 0"),
        (["trainer.eval_temperature=0.5"], "set trainer.eval_samples"),
    ],
)
def test_the_eval_temperature_is_checked(compose, overrides, message):
    from grpo_cli.config import validate

    problems = validate(compose(["model=tiny", *overrides]))
    assert any(message in p for p in problems), problems


def test_the_sampled_evaluation_draws_at_its_own_temperature(compose):
    """trainer.eval_temperature reaches the sampler's draw: near 0 the seeded samples are the
    greedy completions, token for token; at the sampler's own temperature (1.0) on the untrained
    tiny model they are not."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.build import build_data, read_data
    from grpo_cli.config import to_typed
    from grpo_cli.environments.path import RolloutPath
    from grpo_cli.evaluate import grade
    from grpo_cli.models import build_tiny, load_tokenizer, resolve_source
    from grpo_cli.precision import resolve_precision
    from grpo_cli.rewards import Reward, RewardSpec
    from grpo_cli.samplers import Context, build_sampler

    cfg = to_typed(compose(["model=tiny", "data.eval_size=6", "sampler.max_new_tokens=6"]))
    tok = load_tokenizer(resolve_source("builtin:tiny"))
    held_out = build_data(cfg, read_data(cfg), tok).eval
    model = AutoModelForCausalLM.from_pretrained(build_tiny())
    context = Context(
        model,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        precision=resolve_precision("fp32", model.device),
        fast_decode=True,
        tokenizer=tok,  # (an environment's stop strings)
    )
    path = RolloutPath(build_sampler(cfg.sampler, context))
    rewards = [RewardSpec("zero", Reward("zero", fn=lambda completions, **kw: [0.0] * len(completions)), 1.0)]
    seeds = list(range(len(held_out)))

    def ids(**how):
        graded = grade(path, tok, held_out, rewards, num_generations=2, seeds=seeds, **how)
        return graded.rollout.completion_ids

    greedy = ids(greedy=True)
    assert torch.equal(ids(greedy=False, temperature=1e-4), greedy)
    assert not torch.equal(ids(greedy=False), greedy)

    # An environment's episodes: every turn draws at the temperature given (Turn.temperature).
    from grpo_cli.environments.episodes import environment_episodes

    with_env = to_typed(
        compose(["model=tiny", "sampler.max_new_tokens=6", "environment.fn=chat_environments:Lookup"])
    )
    path = RolloutPath(
        path.sampler,
        environment_episodes(with_env, tokenizer=tok, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id),
    )
    greedy = ids(greedy=True)
    assert greedy.shape[1] > 4  # (turns of the model and the tool's reply)
    assert torch.equal(ids(greedy=False, temperature=1e-4), greedy)
    assert not torch.equal(ids(greedy=False), greedy)


def test_the_eval_temperature_reaches_the_evaluation_of_a_run(compose, tmp_path):
    """trainer.eval_temperature through grpo-train's evaluation: near 0 each sampled evaluation's
    pass@1 is its greedy accuracy on every set (the samples are the greedy completions), while at the
    sampler's temperature (the same run without the key) it is not."""
    from grpo_cli.cli.train import train_config
    from grpo_cli.summary import read_metrics

    common = EARLY + [
        "reward=[]",
        "+reward.code.fn=reward_fixtures:char_code",
        "+reward.code.role=correctness",
        "trainer.max_steps=2",
        "trainer.eval_samples=2",
    ]
    rows = {}
    for name, extra in (("cold", ["trainer.eval_temperature=1e-4"]), ("own", [])):
        (tmp_path / name).mkdir()
        train_config(compose(common + extra), tmp_path / name)
        rows[name] = [r for r in read_metrics(tmp_path / name) if "eval/pass@1" in r]
    assert len(rows["cold"]) == 2
    sets = ("eval", "eval_wide", "val")
    assert all(row[f"{s}/pass@1"] == row[f"{s}/accuracy"] for row in rows["cold"] for s in sets), rows["cold"]
    assert any(row[f"{s}/pass@1"] != row[f"{s}/accuracy"] for row in rows["own"] for s in sets), rows["own"]
