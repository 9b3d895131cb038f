"""Tier 3: the training engine on the built-in tiny model, on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import console_script, run_cli
from grpo_cli.engine import run

TINY = ["model=tiny", "data.num_examples=64", "data.eval_size=8", "sampler.num_generations=4",
        "sampler.max_new_tokens=8", "trainer.quiet=true"]


def read_metrics(run_dir, training_only=True):
    """metrics.jsonl rows; the step-0 row of trainer.eval_before holds only eval metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r] if training_only else rows


def flat_params(model):
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def test_console_script_trains_checkpoints_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models import build_tiny

    run_dir = tmp_path / "run"
    common = [console_script("grpo-train"), "model=tiny", "reward=[length]", "reward.length.unit=chars",
              "reward.length.target=4", "loss.beta=0.04", "optimizer.learning_rate=1e-3",
              "data.num_examples=64", "data.eval_size=4", "sampler.num_generations=4",
              "sampler.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.save_steps=2",
              f"hydra.run.dir={run_dir}"]
    res = run_cli(common + ["trainer.max_steps=3"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "self-check ok" in res.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    before = read_metrics(run_dir, training_only=False)[0]
    assert before["step"] == 0 and "eval/reward" in before  # trainer.eval_before (on by default)
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
    for key in ("reward", "reward_std", "rewards/length/mean", "frac_reward_zero_std", "kl",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "entropy", "grad_norm", "learning_rate", "loss",
                "step_time", "tokens_per_second", "pass_rate_hist", "time/rollout", "time/reward",
                "time/reference", "time/policy", "time/optimizer"):
        assert key in rows[0], key
    for row in rows:  # the phases are parts of the step, and beta > 0 here: every phase ran
        phases = [row[k] for k in row if k.startswith("time/")]
        assert all(p > 0 for p in phases) and sum(phases) <= row["step_time"], row
    assert "eval/reward" in rows[-1]

    ckpt = run_dir / "checkpoints" / "step-000003"
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    initial = AutoModelForCausalLM.from_pretrained(build_tiny())
    assert not torch.equal(flat_params(trained), flat_params(initial)), "parameters did not change"
    assert (ckpt / "config.yaml").exists() and (ckpt / "model.safetensors").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]

    res = run_cli(common + ["trainer.max_steps=5", "trainer.resume=auto"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "at step 3" in res.stdout and "self-check" not in res.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert (run_dir / "checkpoints" / "step-000005").is_dir()


def test_dynamic_sampling_refills_the_step_with_groups_that_carry_signal(compose, tmp_path):
    cfg = compose(TINY + ["reward=[accuracy]", "+reward.parity.fn=reward_fixtures:plus_parity",
                          "reward.accuracy.weight=0", "trainer.dynamic_sampling=true",
                          "trainer.max_sampling_tries=8", "trainer.prompts_per_step=2",
                          "trainer.max_steps=2", "data.operations=[+,-]", "loss.beta=0"])
    run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    # Minus prompts always give zero-std groups; the step still trained on whole groups with signal.
    assert any(r["num_groups_sampled"] > 2 for r in rows), rows
    assert all(r["frac_reward_zero_std"] > 0 for r in rows if r["num_groups_sampled"] > 2)
    assert all(r["reward_std"] > 0 for r in rows)


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_truncated_completions_are_masked_when_asked(compose, tmp_path, monkeypatch, mask_truncated):
    # No token ends a completion (EOS is an id outside the vocabulary), so every completion is
    # truncated; masking them leaves no token in the loss and no gradient.
    import grpo_cli.engine

    monkeypatch.setattr(grpo_cli.engine, "eos_token_ids", lambda tokenizer, model: [10**6])
    cfg = compose(TINY + ["reward=[]", "+reward.code.fn=reward_fixtures:char_code",
                          "sampler.max_new_tokens=3", "trainer.max_steps=1", "loss.beta=0",
                          f"loss.mask_truncated_completions={str(mask_truncated).lower()}",
                          "data.eval_size=0"])
    row = run(cfg, tmp_path)
    assert row["completions/clipped_ratio"] == 1.0
    if mask_truncated:
        assert row["grad_norm"] == 0.0
    else:
        assert row["grad_norm"] > 0.0
