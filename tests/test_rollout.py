"""The rollout contract (grpo_cli/rollout.py): a trained-token mask of its own, distinct from the
attention mask, neither a contiguous prefix. A rollout with a hole in its trained tokens (trained,
not trained, trained: what a multi-turn episode makes, the environment's reply between two
sampled turns) is attended to whole and counted by no consumer of "which tokens are trained":
the loss, the KL, the entropy, TIS, the step-0 self-check, the mismatch metric, the logged stats."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import scored_rows

from grpo_cli import selfcheck, step
from grpo_cli.config import Config, LossConfig, SamplerConfig, TrainerConfig
from grpo_cli.logprobs import TokenLogprobs, token_logprobs
from grpo_cli.metrics import UpdateReport, step_row
from grpo_cli.models import load_model, load_tokenizer, resolve_source
from grpo_cli.optim import StepResult
from grpo_cli.packing import MicroBatches
from grpo_cli.precision import resolve_precision
from grpo_cli.rollout import Rollout, concat, select
from grpo_cli.samplers.builtin import sample
from grpo_cli.scored import Batch

G = 2
HOLE = slice(2, 4)  # completion columns 2 and 3: attended, not trained


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


def _holed(model, tok, garbage: float) -> Rollout:
    """2 prompts x G=2 completions of 6 sampled tokens, columns 2-3 turned into 'environment'
    tokens: attended, not trained, and with a sampler log-prob of `garbage` there (nothing may read it)."""
    prompts = [tok("What is 2 plus 3?")["input_ids"], tok("Hi")["input_ids"]]
    r = sample(
        model,
        prompts,
        num_generations=G,
        max_new_tokens=6,
        temperature=1.0,
        eos_ids=[],
        pad_id=tok.pad_token_id,
        seeds=[1, 2],
    )
    trained = r.trained_mask.clone()
    trained[:, HOLE] = 0
    logps = torch.where(trained.bool(), r.sampler_logps, torch.full_like(r.sampler_logps, garbage))
    return replace(r, trained_mask=trained, sampler_logps=logps)


def _batch(r: Rollout, loss_mask=None) -> Batch:
    return Batch(
        scored=scored_rows(r, [1.0, 0.0, 0.0, 1.0]),  # (one reward: the totals)
        advantages=torch.tensor([1.0, -1.0, -1.0, 1.0]),
        zero_std=torch.zeros(4, dtype=torch.bool),
        group_std=torch.full((4,), 0.5),
        loss_mask=r.trained_mask.clone() if loss_mask is None else loss_mask,
    )


class _GradientsKept:
    """The optimizer step's interface (optim.OptimizerStep) that keeps the accumulated gradients
    and does not move the model: the update's gradients are what is compared."""

    scaler, reduces_grads = None, False

    def __init__(self, model):
        self.model, self.grads = model, []

    def backward(self, loss) -> None:
        loss.backward()

    def step(self, loss: float, has_signal: bool) -> StepResult:
        self.grads = [p.grad.clone() for p in self.model.parameters() if p.grad is not None]
        self.model.zero_grad(set_to_none=True)
        return StepResult(True, loss, 0.0, True, "", None)


def _update(model, r: Rollout, garbage: float, monkeypatch):
    """One update of the tiny model on the holed batch (self-check on, TIS on, beta > 0 with
    reference log-probs that are garbage in the hole too); returns its stats, the captured
    grpo_loss calls and the parameters' gradients."""
    calls = []
    real = step.grpo_loss

    def spy(logps, batch, **kw):
        leaf = logps.detach().requires_grad_(True)  # the same loss, on a leaf: its gradient per token
        calls.append({"logps": leaf, "loss": real(leaf, batch, **kw)[0], "mask": batch.mask})
        calls[-1]["weights"] = batch.importance_weights
        return real(logps, batch, **kw)

    monkeypatch.setattr(step, "grpo_loss", spy)
    model.zero_grad()
    lo = LossConfig(beta=0.04, sampler_correction="tis")
    batch = _batch(r)
    ref_logps = torch.where(
        r.trained_mask.bool(), r.sampler_logps - 0.01, torch.full_like(r.sampler_logps, garbage)
    )
    precision = resolve_precision("fp32", torch.device("cpu"), adapted=False)
    opt = _GradientsKept(model)
    updated = step.update(
        batch,
        MicroBatches([torch.arange(4)], 1),
        step.UpdateContext(
            (4, int(r.trained_mask.sum())), True, ref_logps, selfcheck.FirstStep(model, "fp32", 1.0)
        ),
        learner=SimpleNamespace(
            cfg=Config(
                loss=lo, sampler=SamplerConfig(max_new_tokens=6), trainer=TrainerConfig(num_iterations=1)
            ),
            scorer=TokenLogprobs(model, temperature=1.0, shared_prompt=True),
            opt_step=opt,
            precision=precision,
            tolerance=(1e-4, 5e-4),
        ),
    )
    return updated, calls, opt.grads


def test_a_hole_in_the_trained_tokens_is_attended_and_counted_by_no_consumer(tiny, monkeypatch):
    model, tok = tiny
    r = _holed(model, tok, garbage=-30.0)
    hole = torch.zeros_like(r.trained_mask, dtype=torch.bool)
    hole[:, HOLE] = True
    trained = int(r.trained_mask.sum())
    assert trained == 4 * 4 and bool((r.attention_mask[:, HOLE] == 1).all())

    # Attended: the hole's tokens are context for the trained tokens after them.
    with torch.no_grad():
        seen = token_logprobs(model, *r.inputs(), temperature=1.0, num_generations=G)
        unseen_mask = r.attention_mask.masked_fill(hole, 0)
        unseen = token_logprobs(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, unseen_mask, temperature=1.0
        )
    assert float((seen[:, 4:] - unseen[:, 4:]).abs().max()) > 1e-3

    # The self-check passes (a -30 nat "mismatch" in the hole would fail it), over the trained tokens only.
    updated, calls, grads = _update(model, r, -30.0, monkeypatch)
    stats = updated.stats
    assert stats.mismatch_tokens == trained and stats.mismatch_max < 5e-4  # mismatch metric
    assert stats.entropy_tokens == trained  # entropy
    (call,) = calls
    assert torch.equal(call["mask"].bool(), ~hole)  # the loss (and its KL term) mask
    assert bool((call["weights"][hole] == 1.0).all())  # TIS: no weight in the hole
    # The loss (policy term and KL) has exactly zero gradient at every hole position.
    (dlogps,) = torch.autograd.grad(call["loss"], call["logps"])
    assert bool((dlogps[hole] == 0).all()) and bool((dlogps[~hole] != 0).any())

    # Whatever the sampler and the reference said in the hole, the update is the same.
    other = _holed(model, tok, garbage=+5.0)
    _, _, other_grads = _update(model, other, +5.0, monkeypatch)
    assert len(grads) == len(other_grads) > 0 and any(bool(g.abs().sum() > 0) for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, other_grads))


def test_the_hole_is_left_out_of_the_logged_stats(tiny):
    model, tok = tiny
    r = _holed(model, tok, garbage=-30.0)
    rows = scored_rows(r, [1.0, 0, 0, 1.0])
    sampled = step.Sampled(train=rows, drawn=rows)
    updates = step.UpdateStats()
    updates.update(0.0, 1.0)  # one optimizer step's loss and gradient norm
    row = step_row(1, _batch(r), sampled, UpdateReport(updates, 1e-3, time.perf_counter() - 1.0, {}))
    trained = r.trained_mask.bool()
    assert row["sampler/neg_logp_mean"] == pytest.approx(float(-r.sampler_logps[trained].mean()), rel=1e-6)
    assert row["tokens_per_second"] == pytest.approx(int(trained.sum()), rel=0.05)  # ~1 s since `started`
    assert row["completions/mean_length"] == 6.0  # every completion-side token, sampled or not


def test_a_micro_batch_keeps_a_hole_and_its_group_size(tiny):
    model, tok = tiny
    r = _holed(model, tok, garbage=0.0)
    mb = _batch(r).rows(torch.arange(2, 4))
    assert mb.num_generations == G and torch.equal(mb.rollout.trained_mask, r.trained_mask[2:4])
    joined = concat([select(r, torch.arange(2)), select(r, torch.arange(2, 4))], tok.pad_token_id)
    assert torch.equal(joined.trained_mask, r.trained_mask) and joined.num_generations == G
