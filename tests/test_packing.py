"""Micro-batches by a token budget (grpo_cli/packing.py, trainer.micro_batch_tokens): the packing
rules on hand-made group shapes, the plan over ranks, the step's gradient equal to the equal split's
on the tiny model (fp32), and the leak sentinel (one row's tokens never reach another row's
log-probs)."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import scored_rows
from test_rollout import _GradientsKept  # keeps the accumulated gradients, does not step

from grpo_cli import step
from grpo_cli.config import Config, LossConfig, SamplerConfig, TrainerConfig
from grpo_cli.distributed import Dist
from grpo_cli.logprobs import ScoringOptions, TokenLogprobs, length_buckets, score_tokens, token_logprobs
from grpo_cli.models import load_model, load_tokenizer, resolve_source
from grpo_cli.packing import (
    GroupShape,
    MicroBatches,
    ScoringPlan,
    micro_batch_cost,
    pack_groups,
    token_micro_batches,
)
from grpo_cli.precision import resolve_precision
from grpo_cli.rollout import Rollout
from grpo_cli.samplers.builtin import sample
from grpo_cli.scored import Batch

G = 4
# (prompt, width) per group: lengths that differ between groups, as multi-turn episodes' do
SHAPES = [GroupShape(10, w, True) for w in (3, 12, 5, 12, 4, 8)]


@pytest.mark.parametrize("budget", [1, 60, 100, 150, 10_000])
def test_packing_keeps_whole_groups_under_the_budget_and_similar_lengths_together(budget):
    bins = pack_groups(SHAPES, G, budget, prompt_once=True)
    assert sorted(g for b in bins for g in b) == list(range(len(SHAPES)))  # each group once
    for b in bins:
        assert b == sorted(b)  # in the step's order
        cost = micro_batch_cost([SHAPES[g] for g in b], G, True)
        assert cost <= budget or len(b) == 1  # a group over the budget runs alone
    # Next fit over the groups sorted by width: a micro-batch's widths are a run of that order.
    widths = sorted((s.width for s in SHAPES), reverse=True)
    runs = [sorted((SHAPES[g].width for g in b), reverse=True) for b in bins]
    assert sorted(w for r in runs for w in r) == sorted(widths) and all(
        widths[widths.index(r[0]) : widths.index(r[0]) + len(r)] == r for r in runs
    )
    if budget >= micro_batch_cost(SHAPES, G, True):
        assert bins == [list(range(len(SHAPES)))]  # everything fits: one micro-batch, today's


def test_the_cost_counts_a_shared_prompt_once_and_padding_to_the_widest():
    a, b = GroupShape(10, 3, True), GroupShape(6, 12, True)
    assert micro_batch_cost([a, b], G, True) == 2 * (10 + G * 12)
    assert micro_batch_cost([a, b], G, False) == 2 * G * (10 + 12)  # gradient checkpointing: G prompts
    assert micro_batch_cost([a, replace(b, shared=False)], G, True) == 2 * G * (10 + 12)


def test_groups_that_do_not_share_a_prompt_sit_apart():
    """A group whose episodes reset to other prompts would make its micro-batch forward every
    row's prompt: it is sorted after those that share theirs, and joins them only if that fits."""
    shapes = [GroupShape(10, 5, True), GroupShape(10, 5, False), GroupShape(10, 5, True)]
    assert pack_groups(shapes, G, 100, prompt_once=True) == [[0, 2], [1]]  # 60 tokens, then 60
    assert pack_groups(shapes, G, 180, prompt_once=True) == [[0, 1, 2]]  # 3 x 4 x (10 + 5)


@pytest.fixture(scope="module")
def tiny():
    src = resolve_source("builtin:tiny")
    tok = load_tokenizer(src)
    torch.manual_seed(0)
    model = load_model(src, device=torch.device("cpu"))
    with torch.no_grad():  # a sharper distribution: mistakes move the numbers visibly
        for p in model.parameters():
            p.mul_(4.0)
    return model, tok


LENGTHS = [[2, 3, 1, 2], [12, 9, 12, 4], [5, 5, 1, 3], [12, 12, 11, 12], [1, 1, 2, 1], [7, 2, 8, 6]]


def _rollout(model, tok) -> Rollout:
    """6 prompts x G=4 completions, each cut to its length in LENGTHS (the rest right padding):
    groups of other lengths, as EOS makes them."""
    texts = ["What is 2 plus 3?", "Hi", "Count to ten", "3 x 4 =", "Name a colour", "7 - 5"]
    r = sample(
        model,
        [tok(t)["input_ids"] for t in texts],
        num_generations=G,
        max_new_tokens=12,
        temperature=1.0,
        eos_ids=[],
        pad_id=tok.pad_token_id,
        seeds=list(range(6)),
    )
    keep = torch.arange(12) < torch.tensor(LENGTHS).view(-1, 1)  # [24, 12]
    return replace(
        r,
        completion_ids=r.completion_ids.masked_fill(~keep, tok.pad_token_id),
        attention_mask=r.attention_mask * keep,
        trained_mask=r.trained_mask * keep,
        sampler_logps=r.sampler_logps * keep,
    )


def _batch(r: Rollout) -> Batch:
    rewards = torch.tensor([float(i % 3 == 0) for i in range(24)])
    adv = (rewards.view(-1, G) - rewards.view(-1, G).mean(-1, keepdim=True)).flatten()
    zero = (rewards.view(-1, G).std(-1) == 0).repeat_interleave(G)
    return Batch(
        scored=scored_rows(r, rewards.tolist()),  # (one reward: the totals)
        advantages=adv,
        zero_std=zero,
        group_std=rewards.view(-1, G).std(-1).repeat_interleave(G),
        loss_mask=r.trained_mask.clone(),
    )


def _gradients(model, batch: Batch, plan: MicroBatches, lo: LossConfig, buckets: bool = False):
    r = batch.rollout
    ref_logps = torch.where(r.trained_mask.bool(), r.sampler_logps - 0.01, torch.zeros_like(r.sampler_logps))
    opt = _GradientsKept(model)
    model.zero_grad(set_to_none=True)
    norms = step.loss_normalizers(batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std)
    updated = step.update(
        batch,
        plan,
        step.UpdateContext(norms, True, ref_logps, None),
        learner=SimpleNamespace(
            cfg=Config(
                loss=lo, sampler=SamplerConfig(max_new_tokens=12), trainer=TrainerConfig(num_iterations=1)
            ),
            scorer=TokenLogprobs(model, temperature=1.0, shared_prompt=True, length_buckets=buckets),
            opt_step=opt,
            precision=resolve_precision("fp32", torch.device("cpu"), adapted=False),
            tolerance=(1e-4, 5e-4),
        ),
    )
    return opt.grads, updated.stats


@pytest.mark.parametrize(
    "loss", [{"loss_type": "grpo"}, {"loss_type": "dapo"}, {"importance_sampling_level": "sequence"}]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("buckets", [False, True], ids=["whole-groups", "length-buckets"])
def test_a_token_budget_gives_the_equal_splits_gradient(tiny, loss, dtype, buckets, monkeypatch):
    """The same step split into one micro-batch (gradient_accumulation_steps=1), into 3 equal ones,
    and by a token budget (several micro-batches of whole groups, lengths sorted; with
    length-buckets, each micro-batch's rows also run in buckets of similar length, as many as
    there are lengths): the same gradient (beta > 0, TIS, the step's normalisers) up to summation
    order, the same logged entropy. fp32: the budget's split is as close to one micro-batch as the
    equal split is (both ~2e-6 of the gradient's norm); fp64: equal to 1e-12."""
    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)  # (a bucket per length: the most splits)
    model, tok = tiny
    batch = _batch(_rollout(model, tok))
    model = copy.deepcopy(model).to(dtype)
    lo = LossConfig(beta=0.04, sampler_correction="tis", **loss)
    one = MicroBatches([torch.arange(24)], 1)
    three = MicroBatches([torch.arange(i, i + 8) for i in range(0, 24, 8)], 3)
    plan = ScoringPlan(length_buckets=buckets, token_budget=80)
    rows, real = token_micro_batches(batch, plan=plan, skip=None, d=Dist())
    assert real == len(rows) > (1 if buckets else 3) and all(len(r) % G == 0 for r in rows)
    assert sorted(torch.cat(rows).tolist()) == list(range(24))
    budget = MicroBatches(rows, real)
    (g1, s1), (g3, _) = (_gradients(model, batch, plan, lo) for plan in (one, three))
    gb, sb = _gradients(model, batch, budget, lo, buckets)
    assert len(g1) == len(gb) > 0 and any(bool(g.abs().sum() > 0) for g in g1)
    flat = {
        name: torch.cat([g.flatten() for g in grads]) for name, grads in (("1", g1), ("3", g3), ("b", gb))
    }
    rel = {k: float((flat[k] - flat["1"]).norm() / flat["1"].norm()) for k in ("3", "b")}
    bound = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel["b"] < bound and rel["3"] < bound, rel
    assert sb.entropy_tokens == s1.entropy_tokens and sb.entropy_sum == pytest.approx(
        s1.entropy_sum, rel=1e-6
    )


def test_the_budget_runs_fewer_padded_tokens():
    """The tokens the forwards run (prompt once per group, completions at each micro-batch's width)
    fall when groups of other lengths are split apart: LENGTHS' widths are 3, 12, 5, 12, 2, 8."""
    shapes = [GroupShape(6, max(w), True) for w in LENGTHS]
    whole = micro_batch_cost(shapes, G, True)
    packed = sum(
        micro_batch_cost([shapes[g] for g in b], G, True)
        for b in pack_groups(shapes, G, 80, prompt_once=True)
    )
    assert packed < 0.75 * whole


@pytest.mark.parametrize(
    "lengths, overhead, buckets",
    [
        ([5, 5, 5, 5], 0, [[0, 1, 2, 3]]),  # one length: one bucket
        ([1, 1, 1, 100], 10, [[0, 1, 2], [3]]),  # the long row alone saves 297 padded tokens
        ([1, 1, 1, 100], 1000, [[0, 1, 2, 3]]),  # ... unless a pass costs more than that
        ([9, 2, 9, 2], 0, [[1, 3], [0, 2]]),  # rows of equal length together, in order
        ([3, 1, 2], 0, [[1], [2], [0]]),  # no overhead: a bucket per length
        ([0, 0, 4, 4], 1, [[0, 1], [2, 3]]),  # a row with no tokens counts as one
        ([7], 5, [[0]]),
    ],
)
def test_length_buckets_minimise_padded_tokens_plus_a_cost_per_pass(lengths, overhead, buckets):
    assert length_buckets(lengths, overhead) == buckets


def test_bucketed_cost_is_the_buckets_padded_tokens(monkeypatch):
    """With length buckets, one long completion no longer charges its group G times its length."""
    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 16)
    long = GroupShape(10, 100, True, (100, 2, 3, 2))
    assert micro_batch_cost([long], G, True) == 10 + G * 100
    assert micro_batch_cost([long], G, True, bucketed=True) == 10 + 100 + 3 * 3  # [100] + [2, 3, 2]
    other = GroupShape(6, 3, True, (3, 3, 1, 2))  # its rows join the short bucket
    assert micro_batch_cost([long, other], G, True, bucketed=True) == 2 * 10 + 100 + 7 * 3


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_runs_as_many_micro_batches_and_each_group_trains_once(tiny, world):
    model, tok = tiny
    batch = _batch(_rollout(model, tok))
    skip = batch.zero_std.clone()
    plans = [
        token_micro_batches(
            batch, plan=ScoringPlan(token_budget=80), skip=skip, d=Dist(rank=k, world_size=world)
        )
        for k in range(world)
    ]
    assert len({len(rows) for rows, _ in plans}) == 1  # the same count: DDP's last backward, FSDP2
    wide = [
        token_micro_batches(
            batch, plan=ScoringPlan(token_budget=10**6), skip=None, d=Dist(rank=k, world_size=world)
        )
        for k in range(world)
    ]
    assert all(real >= 1 for _, real in wide)  # a budget that holds the whole step: every rank still works
    trained = sorted(torch.cat([torch.cat(rows[:real]) for rows, real in plans if real]).tolist())
    assert trained == [i for i in range(24) if not skip[i]]  # zero-std groups skipped, the rest once
    for rows, real in plans:  # stand-ins: whole groups, at weight 0 in update()
        assert all(len(r) == G for r in rows[real:])


@pytest.mark.parametrize("buckets", [False, True], ids=["one-pass", "length-buckets"])
def test_a_row_never_sees_another_rows_tokens(tiny, buckets, monkeypatch):
    """The leak sentinel: changing one row's completion tokens (in a micro-batch with the others,
    prompts forwarded once; or run in length buckets: row 2 shares its bucket with row 0) leaves
    every other row's log-probs as they were (bit for bit), and the buckets' scores equal one pass's:
    that equality holds up to summation order only, so the model runs in float64 (in fp32 the vector
    units change the order: 6.2e-6 on an AVX512-BF16 EPYC, issue #58); the scorer's log-softmax
    still runs in fp32, hence 1e-6 (test_chunked_logprobs.LOOSE)."""
    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)
    model, tok = tiny
    r = _rollout(model, tok)
    model = copy.deepcopy(model).double()
    rows = torch.arange(4, 8)  # group 1: the long one, lengths 12, 9, 12, 4
    sub = _batch(r).rollout if buckets else _batch(r).rows(rows).rollout
    at = (rows if buckets else rows - 4).tolist()
    options = ScoringOptions(1.0, length_buckets=buckets)
    with torch.no_grad():
        before = score_tokens(model, *sub.inputs(), options, G).logps
        changed = sub.completion_ids.clone()
        changed[at[2], :] = (changed[at[2], :] + 7) % 100
        after = score_tokens(
            model, sub.prompt_ids, sub.prompt_mask, changed, sub.attention_mask, options, G
        ).logps
        plain = token_logprobs(model, *sub.inputs(), temperature=1.0, num_generations=G)
    others = torch.tensor([i for i in range(len(before)) if i != at[2]])
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[at[2]], after[at[2]])
    mask = sub.attention_mask.bool()
    torch.testing.assert_close(before[mask], plain[mask], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.micro_batch_tokens=0"], "trainer.micro_batch_tokens=0 must be a positive number"),
        (
            ["trainer.micro_batch_tokens=4096", "trainer.gradient_accumulation_steps=2"],
            "trainer.gradient_accumulation_steps=2 is ignored",
        ),
        (["trainer.micro_batch_tokens=4096", "trainer.num_processes=3"], "cannot be shared by 3 processes"),
    ],
)
def test_token_budget_settings_are_checked(compose, overrides, message):
    from grpo_cli.config import validate

    problems = validate(compose(["model=tiny"] + overrides))
    assert len(problems) == 1 and message in problems[0], problems


def test_a_token_budget_trains_the_tiny_model_and_resumes_bit_exact(compose, tmp_path, monkeypatch):
    """From YAML, a budget that splits the step (gradient checkpointing on: every row's prompt
    counted; rows in length buckets, a bucket per length), two iterations per step: the weights
    move, and a run stopped after 2 steps and resumed to 3 ends with the weights of 3 steps in one
    go (the plan is a function of the step's rollouts; the shuffle's RNG is in the checkpoint)."""
    from conftest import tiny as tiny_overrides
    from safetensors.torch import load_file

    from grpo_cli.cli.train import train_config
    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)

    common = tiny_overrides(
        "data.eval_size=0",
        "trainer.save_steps=2",
        "trainer.micro_batch_tokens=48",
        "trainer.num_iterations=2",
        "trainer.gradient_checkpointing=true",
    )
    for d in ("whole", "split"):
        (tmp_path / d).mkdir()
    row = train_config(compose(common + ["trainer.max_steps=3"]), tmp_path / "whole")
    assert row["grad_norm"] > 0
    train_config(compose(common + ["trainer.max_steps=2"]), tmp_path / "split")
    train_config(compose(common + ["trainer.max_steps=3", "trainer.resume=auto"]), tmp_path / "split")
    whole, split = (
        load_file(max((tmp_path / d / "checkpoints").iterdir()) / "model.safetensors")
        for d in ("whole", "split")
    )
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_a_token_budget_trains_multi_turn_episodes_with_lora(compose, tmp_path, monkeypatch):
    """environment=calculator (episodes with tool replies: completions with holes, measured by their
    last attended column) under LoRA adapters, with a budget that splits the step and rows in
    length buckets (a bucket per length, under the shared prompts' cache): it trains."""
    from conftest import tiny as tiny_overrides

    from grpo_cli.cli.train import train_config
    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)

    cfg = compose(
        tiny_overrides(
            "environment=calculator",
            "adapter=lora",
            "adapter.r=4",
            "data.eval_size=0",
            "trainer.max_steps=2",
            "trainer.micro_batch_tokens=64",
        )
    )
    row = train_config(cfg, tmp_path)
    assert row["grad_norm"] > 0 and row["env/turns"] >= 1
