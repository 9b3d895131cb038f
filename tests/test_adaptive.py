"""Spending compute where it teaches: adaptive group sizes (sampler.max_generations) and the skip
of zero-std groups' forward/backward (trainer.skip_zero_std) on the tiny model, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny
from safetensors.torch import load_file

from grpo_cli.cli.train import train_config
from grpo_cli.distributed import prompt_seed
from grpo_cli.step import balanced_group

T, F = True, False


@pytest.mark.parametrize(
    "passed,G,want",
    [
        ([F, T, F, T], 4, [0, 1, 2, 3]),  # mixed in the first round: the first group, as without rounds
        ([F] * 8, 4, [0, 1, 2, 3]),  # never mixed: the first round's group
        ([T] * 12, 4, [0, 1, 2, 3]),
        ([F] * 7 + [T], 4, [0, 1, 2, 7]),  # one rare pass: it and the first 3 fails
        ([F] * 5 + [T, T, T], 4, [0, 1, 5, 6]),  # half and half
        ([T] * 6 + [F, T], 4, [0, 1, 2, 6]),  # one rare fail
        ([F] * 9 + [T] * 2 + [F] * 5, 8, [0, 1, 2, 3, 4, 5, 9, 10]),  # both passes, 6 fails
    ],
)
def test_balanced_group_takes_the_rare_outcome_and_half_of_the_group_at_most(passed, G, want):
    assert balanced_group(passed, G) == want


def test_round_zero_keeps_the_seed_a_prompt_always_had_and_rounds_draw_new_ones():
    assert prompt_seed(3, 5, 2) == prompt_seed(3, 5, 2, 0)
    seeds = {prompt_seed(3, 5, 2, r) for r in range(4)}
    assert len(seeds) == 4


def run(cfg, run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    return train_config(cfg, run_dir)


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def final_weights(run_dir):
    return load_file(max((run_dir / "checkpoints").iterdir()) / "model.safetensors")


SKIP = tiny(
    "reward=[]",
    "+reward.code.fn=reward_fixtures:plus_parity",  # signal on plus prompts only: other groups zero-std
    "loss.beta=0.04",  # the reference pass is skipped too
    "optimizer.learning_rate=1e-3",
    "trainer.prompts_per_step=4",
    "trainer.max_steps=3",
    "trainer.eval_before=false",
    "data.eval_size=4",
    "trainer.precision=fp32",
    "trainer.seed=2",
)


def _same(a, b):
    return a == b or (a != a and b != b)  # (NaN: a step that trained on no row)


@pytest.mark.parametrize(
    "accumulation,exact",
    [(4, True), (1, False)],
    ids=["a-group-per-micro-batch", "groups-packed"],
)
def test_skipping_zero_std_groups_leaves_the_update_unchanged(compose, tmp_path, accumulation, exact):
    """With loss.zero_std=mask a zero-std group's loss terms are exactly 0, so leaving its rows out
    of the forward/backward and the reference pass changes nothing: with one group per micro-batch
    the weights are bit-identical (the others' forward is the same computation, and the random
    order of the micro-batches is drawn as before). Packed with other groups, the smaller batch
    may round differently in the last bits (the kernels' blocking follows the batch's shape)."""
    runs = {}
    for skip in (True, False):
        cfg = compose(
            SKIP + [f"trainer.gradient_accumulation_steps={accumulation}", f"trainer.skip_zero_std={skip}"]
        )
        run(cfg, tmp_path / str(skip))
        runs[skip] = (metrics(tmp_path / str(skip)), final_weights(tmp_path / str(skip)))
    (rows_skip, w_skip), (rows_all, w_all) = runs[True], runs[False]
    rows = [r["num_rows_trained"] for r in rows_skip]
    assert [r["num_rows_trained"] for r in rows_all] == [16] * 3
    # Step 1 runs every row (its self-check compares them all); later steps only the groups with signal.
    assert rows == [16] + [round(16 * (1 - r["frac_reward_zero_std"])) for r in rows_skip[1:]]
    assert min(rows) < 16, rows  # some groups were skipped (the fixture's seed has them)
    for a, b in zip(rows_skip, rows_all):
        for key in ("reward", "reward_std", "frac_reward_zero_std", "loss", "grad_norm", "kl"):
            assert _same(a[key], b[key]) if exact else a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (
                key
            )
    if exact:
        assert all(torch.equal(w_skip[k], w_all[k]) for k in w_all)
    else:  # the update as a whole (Adam turns a near-zero gradient's rounding into +-lr either way)
        from grpo_cli.models import build_tiny

        start = load_file(f"{build_tiny()}/model.safetensors")
        moved = torch.cat([(w_all[k] - start[k]).flatten() for k in sorted(w_all)])
        gap = torch.cat([(w_skip[k] - w_all[k]).flatten() for k in sorted(w_all)])
        assert float(moved.abs().max()) > 1e-3 and float(gap.norm() / moved.norm()) < 1e-4


ADAPTIVE = tiny(
    "reward=[]",
    "+reward.code.fn=reward_fixtures:rare_pass",  # a pass in ~1 of 10 completions
    "optimizer.learning_rate=1e-3",
    "trainer.prompts_per_step=4",
    "trainer.eval_before=false",
    "data.eval_size=4",
    "trainer.precision=fp32",
    "sampler.max_generations=16",
    "trainer.save_steps=2",
    "trainer.keep_last=5",
)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


def groups(run_dir, step):
    """A step's trained groups from completions.jsonl: group -> [(completion, reward)]."""
    out = {}
    for r in records(run_dir):
        if r["step"] == step:
            out.setdefault(r["group"], []).append((r["completion"], r["reward"]))
    return out


def test_adaptive_group_sizes_sample_more_rounds_for_unmixed_prompts_and_train_on_g(compose, tmp_path):
    """Prompts whose 4 completions all fail get 4 more per round, up to 16; the step trains on
    groups of 4, more of them with signal than without the rounds; a prompt that mixed in its
    first round trains on the very group the plain run samples (same seeds)."""
    run(compose(ADAPTIVE + ["trainer.max_steps=3"]), tmp_path / "ada")
    plain_args = [a for a in ADAPTIVE if not a.startswith("sampler.max_generations")]
    run(compose(plain_args + ["trainer.max_steps=3"]), tmp_path / "plain")
    ada, plain = metrics(tmp_path / "ada"), metrics(tmp_path / "plain")
    for r in ada:
        n = r["num_completions_sampled"]
        assert 16 <= n <= 64 and n % 4 == 0
        assert (n > 16) == (r["num_groups_resampled"] > 0)
        assert r["num_groups_rescued"] <= r["num_groups_resampled"] <= 4
        trained = groups(tmp_path / "ada", r["step"])
        assert sorted(len(g) for g in trained.values()) == [4] * 4
        mixed = sum(len({reward for _, reward in g}) == 2 for g in trained.values())
        assert mixed == round(4 * (1 - r["frac_reward_zero_std"]))
    assert [r["num_completions_sampled"] for r in plain] == [16] * 3
    assert [r["num_groups_resampled"] for r in plain] == [0] * 3
    assert sum(r["num_groups_rescued"] for r in ada) > 0
    assert sum(r["frac_reward_zero_std"] for r in ada) < sum(r["frac_reward_zero_std"] for r in plain)
    first_ada, first_plain = groups(tmp_path / "ada", 1), groups(tmp_path / "plain", 1)
    at_once = [g for g, rows in first_plain.items() if len({reward for _, reward in rows}) == 2]
    assert at_once, "the fixture's seed should have a group that mixes in its first round"
    assert all(first_ada[g] == first_plain[g] for g in at_once)


def test_adaptive_group_sizes_resume_bit_exact(compose, tmp_path):
    """2 steps, then resumed to 4: the same samples (seeds of seed, step, prompt, round) and the
    same weights as 4 steps in one go."""
    run(compose(ADAPTIVE + ["trainer.max_steps=4"]), tmp_path / "whole")
    run(compose(ADAPTIVE + ["trainer.max_steps=2"]), tmp_path / "split")
    run(compose(ADAPTIVE + ["trainer.max_steps=4", "trainer.resume=auto"]), tmp_path / "split")
    whole, split = final_weights(tmp_path / "whole"), final_weights(tmp_path / "split")
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    keep = ("step", "reward", "num_completions_sampled", "num_groups_resampled", "num_groups_rescued", "loss")
    assert [[r[k] for k in keep] for r in metrics(tmp_path / "split")] == [
        [r[k] for k in keep] for r in metrics(tmp_path / "whole")
    ]
