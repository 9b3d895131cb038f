"""The loop around the loss: what every iteration of a step logs, steps without learning signal,
and which old log-probs the ratio uses (ref 000.1, ref 002). Tiny model, CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import reward_fixtures
import torch
from conftest import tiny
from safetensors.torch import load_file

from grpo_cli import step
from grpo_cli.cli.train import train_config as run
from grpo_cli.samplers import builtin

TINY = tiny(
    "data.eval_size=0",
    "trainer.eval_before=false",
)
LENGTH = ["reward=[length]", "reward.length.unit=chars", "reward.length.target=4"]


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def loss_calls(monkeypatch):
    """Every grpo_loss call of the training step: its inputs and its stats."""
    calls = []
    real = step.grpo_loss

    def spy(logps, batch, **kw):
        loss, stats = real(logps, batch, **kw)
        calls.append(
            {
                "logps": logps.detach().clone(),
                "old": batch.old_logps.detach().clone(),
                "mask": batch.mask.clone(),
                "weights": batch.importance_weights,
                "stats": {k: float(v) for k, v in stats.items()},
                "loss": float(loss.detach()),
            }
        )
        return loss, stats

    monkeypatch.setattr(step, "grpo_loss", spy)
    return calls


def test_clip_and_ratio_metrics_cover_every_iteration(compose, tmp_path, loss_calls):
    """num_iterations=4 at a high learning rate: iterations 1-3 clip; the logged clip ratios and
    ratio stats are token-weighted means over all 4 updates (maxima over all), loss and grad_norm
    means over the updates, and the last iteration's clip ratio is kept too."""
    cfg = compose(
        TINY
        + LENGTH
        + [
            "trainer.num_iterations=4",
            "optimizer.learning_rate=0.05",
            "trainer.max_steps=1",
            "trainer.prompts_per_step=2",
            "trainer.gradient_accumulation_steps=2",
            "loss.beta=0",
            "trainer.seed=4",  # (a seed whose two groups both carry signal)
        ]
    )
    row = run(cfg, tmp_path)
    assert len(loss_calls) == 8  # 4 iterations x 2 micro-batches
    tokens = [c["stats"]["num_tokens"] for c in loss_calls]
    for key in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "ratio_mean", "kl"):
        want = sum(c["stats"][key] * n for c, n in zip(loss_calls, tokens)) / sum(tokens)
        assert row[key] == pytest.approx(want, rel=1e-6, abs=1e-9), key
    assert row["ratio_max"] == max(c["stats"]["ratio_max"] for c in loss_calls)
    last = loss_calls[-2:]
    want_last = sum(c["stats"]["clip_ratio/region_mean"] * c["stats"]["num_tokens"] for c in last) / sum(
        c["stats"]["num_tokens"] for c in last
    )
    assert row["clip_ratio/region_mean_last"] == pytest.approx(want_last, rel=1e-6, abs=1e-9)
    # Iteration 0 is on-policy (ratio exactly 1); the later ones moved and clipped.
    assert all(c["stats"]["ratio_max"] == 1.0 for c in loss_calls[:2])
    assert row["ratio_max"] > 1.5 and row["clip_ratio/region_mean"] > 0.05
    per_update = [loss_calls[i]["loss"] + loss_calls[i + 1]["loss"] for i in range(0, 8, 2)]
    assert row["loss"] == pytest.approx(sum(per_update) / 4, rel=1e-6, abs=1e-9)
    assert row["grad_norm_max"] >= row["grad_norm"] > 0


def test_a_step_without_learning_signal_does_not_move_the_weights(compose, tmp_path, capsys):
    """After one step with signal, two steps whose groups are all zero-std: the optimizer and the
    scheduler do not step, so AdamW's momentum and weight decay cannot move the weights."""
    reward_fixtures.SIGNAL_CALLS["n"] = 0
    cfg = compose(
        TINY
        + [
            "reward=[]",
            "+reward.once.fn=reward_fixtures:signal_once",
            "trainer.max_steps=3",
            "trainer.prompts_per_step=2",
            "trainer.save_steps=1",
            "trainer.keep_last=3",
            "optimizer.learning_rate=1e-2",
            "optimizer.weight_decay=0.1",
            "optimizer.lr_scheduler=linear",
            "loss.beta=0.04",
            "trainer.quiet=false",
        ]
    )
    run(cfg, tmp_path)
    rows = read_rows(tmp_path)
    assert [r["skipped_updates/no_signal"] for r in rows] == [0, 1, 1]
    assert [r["skipped_updates"] for r in rows] == [0, 1, 1]
    assert rows[1]["learning_rate"] == rows[0]["learning_rate"] == rows[2]["learning_rate"]  # scheduler held
    weights = [
        load_file(tmp_path / "checkpoints" / f"step-00000{s}" / "model.safetensors") for s in (1, 2, 3)
    ]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
        assert torch.equal(weights[0][name], weights[2][name]), name
    out = capsys.readouterr()
    assert (out.out + out.err).count("no learning signal") == 1


def test_masked_truncation_leaving_no_token_skips_the_update(compose, tmp_path):
    cfg = compose(
        TINY
        + [
            "sampler.max_new_tokens=3",
            "sampler.ignore_eos=true",
            "trainer.max_steps=1",
            "loss.mask_truncated_completions=true",
            "reward=[]",
            "+reward.code.fn=reward_fixtures:char_code",
        ]
    )
    row = run(cfg, tmp_path)
    assert row["skipped_updates/no_signal"] == 1 and row["grad_norm"] == 0.0


@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
@pytest.mark.parametrize("num_iterations", [1, 3])
def test_old_logprobs_are_the_trainers_own_so_the_first_ratio_is_exactly_one_in_bf16(
    compose, tmp_path, loss_calls, num_iterations, precision
):
    """Under bf16 (weights or autocast) the KV-cache decode and the training forward round differently; the
    ratio's old log-probs are the training forward's (detached) from before the first update,
    so the first ratio is exactly 1 and later iterations reuse those same old log-probs. The
    sampler/trainer mismatch is logged instead."""
    cfg = compose(
        TINY
        + LENGTH
        + [
            f"trainer.precision={precision}",
            "trainer.max_steps=1",
            "trainer.prompts_per_step=2",
            "sampler.max_new_tokens=16",
            f"trainer.num_iterations={num_iterations}",
            "optimizer.learning_rate=1e-2",
            "loss.beta=0",
        ]
    )
    row = run(cfg, tmp_path)
    first = loss_calls[0]
    assert torch.equal(first["old"], first["logps"])
    assert first["stats"]["ratio_max"] == 1.0 and first["stats"]["ratio_mean"] == 1.0
    assert row["sampler/logp_diff_max"] > 0  # bf16: the sampler's numbers differ, and that is measured
    assert row["sampler/logp_diff_mean"] <= row["sampler/logp_diff_max"]
    for later in loss_calls[1:]:
        assert torch.equal(later["old"], first["old"])
    if num_iterations > 1:
        assert not torch.equal(loss_calls[-1]["logps"], first["logps"])  # the policy moved


def test_tis_weights_the_policy_term_by_the_capped_trainer_sampler_ratio(
    compose, tmp_path, loss_calls, monkeypatch
):
    """loss.sampler_correction=tis passes min(exp(trainer - sampler), cap) per token."""
    sampled = {}
    real_sample = builtin.sample

    def sample(*a, **kw):
        out = real_sample(*a, **kw)
        out = replace(
            out, sampler_logps=out.sampler_logps - 0.5 * out.trained_mask
        )  # a sampler that disagrees
        sampled["logps"] = out.sampler_logps.clone()
        return out

    monkeypatch.setattr(builtin, "sample", sample)
    cfg = compose(
        TINY
        + LENGTH
        + [
            "trainer.max_steps=1",
            "loss.sampler_correction=tis",
            "loss.tis_cap=1.5",
            "trainer.self_check=false",
            "loss.beta=0",
        ]
    )
    row = run(cfg, tmp_path)
    call = loss_calls[0]
    valid = call["mask"].bool()
    weights = call["weights"]
    assert weights is not None
    # exp(0.5) = 1.65 > cap: every valid token is capped at 1.5.
    assert torch.allclose(weights[valid], torch.full_like(weights[valid], 1.5))
    assert row["sampler/logp_diff_mean"] == pytest.approx(0.5, abs=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_self_check_covers_every_micro_batch_of_the_first_step(compose, tmp_path, monkeypatch, seed):
    """A sampler whose log-probs are wrong for one group of four: the self-check fails, whichever
    micro-batch comes first in the shuffled order."""
    from grpo_cli.selfcheck import SelfCheckError

    real_sample = builtin.sample

    def sample(*a, **kw):
        out = real_sample(*a, **kw)
        G = kw["num_generations"]
        wrong = out.sampler_logps.clone()
        wrong[-G:] -= 0.5 * out.trained_mask[-G:]  # the last group's rows
        return replace(out, sampler_logps=wrong)

    monkeypatch.setattr(builtin, "sample", sample)
    cfg = compose(
        TINY
        + LENGTH
        + [
            "trainer.max_steps=1",
            "trainer.prompts_per_step=4",
            "trainer.gradient_accumulation_steps=4",
            f"trainer.seed={seed}",
        ]
    )
    with pytest.raises(SelfCheckError, match="self-check failed"):
        run(cfg, tmp_path)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-autocast"])
def test_self_check_names_a_temperature_mismatch_in_every_precision(
    compose, tmp_path, monkeypatch, precision
):
    """The sampler draws at temperature 0.5 while the trainer scores at 1.0: caught before any
    update, in bf16 too (its tolerance is loose enough for rounding, not for this bug)."""
    from grpo_cli.selfcheck import SelfCheckError

    real_sample = builtin.sample
    monkeypatch.setattr(builtin, "sample", lambda *a, **kw: real_sample(*a, **{**kw, "temperature": 0.5}))
    cfg = compose(
        TINY + LENGTH + ["trainer.max_steps=1", f"trainer.precision={precision}", "sampler.max_new_tokens=16"]
    )
    with pytest.raises(SelfCheckError, match="self-check failed"):
        run(cfg, tmp_path)
