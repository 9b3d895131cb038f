"""Log-probs and rollouts on the built-in tiny model (ref 000.2 shift, 000.3 padding, 000.4
temperature, 000.1 sampler log-probs)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import scored_rows

from grpo_cli import logprobs as logprobs_mod
from grpo_cli.logprobs import filter_logits, padding_bounds, token_logprobs
from grpo_cli.models import load_model, load_tokenizer, resolve_source
from grpo_cli.rollout import Rollout, single_turn
from grpo_cli.samplers.builtin import draw, left_pad, sample
from grpo_cli.scored import Batch


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    src = resolve_source("builtin:tiny")
    tok = load_tokenizer(src)
    model = load_model(src, device=torch.device("cpu"))
    # The cached tiny model is random-init with small weights; sharpen it so the distribution is
    # far from uniform and mistakes (shift, temperature) change the numbers visibly.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    model.eval()
    return model, tok


def slow_reference(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """One unpadded sequence, full log_softmax, explicit shift: the textbook computation."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    logp = F.log_softmax(logits[:-1], dim=-1)  # position t predicts token t+1
    targets = ids[0, 1:]
    return logp.gather(-1, targets[:, None]).squeeze(-1)[-len(completion) :]


def batch_of(tok, prompts, completions):
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id, "cpu")
    C = max(len(c) for c in completions)
    c_ids = torch.full((len(completions), C), tok.pad_token_id)
    c_mask = torch.zeros((len(completions), C), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = 1
    return p_ids, p_mask, c_ids, c_mask


PROMPTS = ["What is 2 plus 3?", "Hi", "A much longer prompt that forces left padding on the others."]
COMPLETIONS = ["5", "Hello there", "ok then"]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_batched_logprobs_equal_slow_one_at_a_time_reference(tiny, temperature):
    model, tok = tiny
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    completions = [tok(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS]
    logps = token_logprobs(model, *batch_of(tok, prompts, completions), temperature=temperature)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        expected = slow_reference(model, p, c, temperature)
        torch.testing.assert_close(logps[i, : len(c)], expected, atol=1e-4, rtol=1e-4)


def test_logprobs_do_not_change_when_batched_with_longer_sequences(tiny):
    model, tok = tiny
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    completions = [tok(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS]
    alone = token_logprobs(model, *batch_of(tok, prompts[:1], completions[:1]), temperature=1.0)
    together = token_logprobs(model, *batch_of(tok, prompts, completions), temperature=1.0)
    n = len(completions[0])
    torch.testing.assert_close(together[0, :n], alone[0, :n], atol=1e-5, rtol=1e-5)


def _grouped_batch(tok, G=3):
    """Two groups of G rows: each group repeats one prompt with G different completions."""
    prompts, completions = [], []
    for prompt in PROMPTS[:2]:
        for c in ["5", "Hello there", "ok then!"][:G]:
            prompts.append(tok(prompt)["input_ids"])
            completions.append(tok(c, add_special_tokens=False)["input_ids"])
    return batch_of(tok, prompts, completions)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_forward_matches_full_rows_in_values_and_gradients(tiny, temperature):
    """The grouped path (each prompt run once, its KV cache shared by the group's completions:
    the rows' num_generations) gives the same log-probs and the same gradients as running every
    full row."""
    model, tok = tiny
    batch = _grouped_batch(tok)

    def logps_and_grads(num_generations):
        model.zero_grad()
        logps = token_logprobs(model, *batch, temperature=temperature, num_generations=num_generations)
        (logps * batch[3]).sum().backward()
        return logps.detach(), [p.grad.clone() for p in model.parameters()]

    shared, shared_grads = logps_and_grads(3)
    full, full_grads = logps_and_grads(1)
    model.zero_grad()
    valid = batch[3].bool()
    torch.testing.assert_close(shared[valid], full[valid], atol=1e-5, rtol=1e-5)
    for a, b in zip(shared_grads, full_grads):  # float rounding only: relative to the gradient's size
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-6, float((a - b).norm() / b.norm())
    for i in range(valid.shape[0]):  # and both equal the one-sequence textbook computation
        p = batch[0][i][batch[1][i].bool()].tolist()
        c = batch[2][i][valid[i]].tolist()
        torch.testing.assert_close(
            shared[i, : len(c)], slow_reference(model, p, c, temperature).detach(), atol=1e-4, rtol=1e-4
        )


def test_rows_that_are_not_groups_of_num_generations_are_refused(tiny):
    model, tok = tiny
    batch = _grouped_batch(tok)  # 6 rows
    with pytest.raises(ValueError, match="not groups of num_generations=4"):
        token_logprobs(model, *batch, temperature=1.0, num_generations=4)


def test_padding_bounds_reach_the_last_attended_column_through_holes():
    prompt_mask = torch.tensor([[0, 0, 1], [0, 1, 1]])
    attention = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]])  # a hole in row 0
    assert padding_bounds(prompt_mask, attention) == (1, 4)


def test_temperature_is_honoured(tiny):
    model, tok = tiny
    batch = batch_of(
        tok, [tok(PROMPTS[0])["input_ids"]], [tok("12345", add_special_tokens=False)["input_ids"]]
    )
    cold = token_logprobs(model, *batch, temperature=0.5)
    warm = token_logprobs(model, *batch, temperature=1.0)
    assert (cold - warm).abs().max() > 1e-2


def test_micro_batch_rows_drop_all_pad_columns_only(tiny):
    _, tok = tiny
    p_ids, p_mask, c_ids, c_mask = batch_of(tok, [[5, 6], [7, 8, 9]], [[1], [2, 3]])
    p_ids = torch.cat([torch.full((2, 3), tok.pad_token_id), p_ids], 1)  # 3 extra pad columns
    p_mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), p_mask], 1)
    c_ids = torch.cat([c_ids, torch.full((2, 4), tok.pad_token_id)], 1)
    c_mask = torch.cat([c_mask, torch.zeros(2, 4, dtype=torch.long)], 1)
    rollout = single_turn(
        1, p_ids, p_mask, c_ids, c_mask, torch.zeros(2, dtype=torch.bool), torch.zeros(c_ids.shape)
    )
    batch = Batch(
        scored_rows(rollout, [0.0, 0.0]),
        advantages=torch.zeros(2),
        zero_std=torch.zeros(2, dtype=torch.bool),
        group_std=torch.zeros(2),
        loss_mask=c_mask.clone(),
    )
    mb = batch.rows(torch.arange(2))
    tp, tm, tc, tcm = mb.rollout.inputs()
    assert tp.shape == (2, 3) and tc.shape == (2, 2)
    assert tm.sum() == p_mask.sum() and tcm.sum() == c_mask.sum()
    assert mb.rollout.sampler_logps.shape == mb.loss_mask.shape == mb.rollout.trained_mask.shape == (2, 2)


def test_rollout_refuses_a_trained_token_that_is_not_attended_and_rows_that_are_not_groups():
    ids = torch.zeros(4, 3, dtype=torch.long)
    attended = torch.tensor([[1, 1, 0]] * 4)
    args = (ids, torch.ones(4, 2, dtype=torch.long), ids, attended)
    rest = dict(roles=attended, episode_stats=torch.zeros(4, 0), env_reward=torch.zeros(4))
    with pytest.raises(ValueError, match="trained token must be attended"):
        Rollout(
            2,
            *args,
            torch.tensor([[1, 1, 1]] * 4),
            torch.zeros(4, dtype=torch.bool),
            torch.zeros(4, 3),
            **rest,
        )
    with pytest.raises(ValueError, match="not groups of num_generations=3"):
        Rollout(3, *args, attended, torch.zeros(4, dtype=torch.bool), torch.zeros(4, 3), **rest)


def test_greedy_rollout_matches_generate(tiny):
    model, tok = tiny
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    r = sample(
        model,
        prompts,
        num_generations=1,
        max_new_tokens=10,
        temperature=1.0,
        greedy=True,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
    )
    ids, mask = left_pad(prompts, tok.pad_token_id, "cpu")
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, ids.shape[1] :]
    torch.testing.assert_close(r.completion_ids[:, : ref.shape[1]], ref)


@pytest.fixture(scope="module")
def spread_tiny():
    """The tiny model sharpened less than `tiny`: a first-token distribution over ~20 tokens, so
    histograms tell distributions apart."""
    torch.manual_seed(0)
    src = resolve_source("builtin:tiny")
    model = load_model(src, device=torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval(), load_tokenizer(src)


def _pooled(counts: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0):
    """Bins with fewer than min_expected counts pooled into one (the chi-square rule)."""
    small = expected < min_expected
    return (
        torch.cat([counts[~small], counts[small].sum(0, keepdim=True)]),
        torch.cat([expected[~small], expected[small].sum(0, keepdim=True)]),
    )


def _chi2_fits(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's goodness-of-fit: counts drawn from p? Threshold df + 6 sqrt(2 df) (a false
    alarm about once in a million runs)."""
    obs, exp = _pooled(counts.float(), p * counts.sum())
    keep = exp > 0
    stat, df = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1
    return stat < df + 6 * math.sqrt(2 * df)


def _chi2_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two-sample chi-square: histograms a and b (counts) from the same distribution?"""
    ka, kb = math.sqrt(b.sum() / a.sum()), math.sqrt(a.sum() / b.sum())
    obs_a, obs_b = _pooled(torch.stack([a.float(), b.float()], 1), (a + b).float() / 2)[0].unbind(1)
    keep = obs_a + obs_b > 0
    stat = float(((ka * obs_a[keep] - kb * obs_b[keep]) ** 2 / (obs_a[keep] + obs_b[keep])).sum())
    df = int(keep.sum()) - 1
    return stat < df + 6 * math.sqrt(2 * df)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 5, 1.0)])
def test_sampling_draws_from_the_same_distribution_as_generate(spread_tiny, temperature, top_k, top_p):
    """5000 completions from our sampler and from generate: the first-token counts pass a
    chi-square test against the exact tempered, truncated softmax, and the second-token
    counts a two-sample test against generate's. The same test rejects counts drawn at 1.25x
    the temperature (asserted, so the test keeps its power)."""
    model, tok = spread_tiny
    prompt = tok(PROMPTS[0])["input_ids"]
    n, V = 5000, model.config.vocab_size
    torch.manual_seed(1)
    ours = sample(
        model,
        [prompt],
        num_generations=n,
        max_new_tokens=2,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
    ).completion_ids
    ids = torch.tensor([prompt])
    theirs = model.generate(
        input_ids=ids.expand(n, -1).contiguous(),
        attention_mask=torch.ones(n, len(prompt), dtype=torch.long),
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, len(prompt) :]

    def counts(tokens):
        return torch.bincount(tokens, minlength=V)

    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1].float()
    exact = filter_logits(logits / temperature, top_k, top_p).softmax(-1)[0]
    wrong = filter_logits(logits / (temperature * 1.25), top_k, top_p).softmax(-1)[0]
    wrong_draws = draw(wrong.expand(n, -1), torch.Generator().manual_seed(2))
    assert not _chi2_fits(counts(wrong_draws), exact)  # the test can see a wrong temperature
    assert _chi2_fits(counts(ours[:, 0]), exact)
    assert _chi2_fits(counts(theirs[:, 0]), exact)
    assert not torch.isinf(exact.log()[ours[:, 0]]).any()  # never a token outside top-k/top-p
    # Second token, rows whose first token was not EOS (generate keeps going after EOS).
    a = ours[ours[:, 0] != tok.eos_token_id, 1]
    b = theirs[theirs[:, 0] != tok.eos_token_id, 1]
    assert _chi2_same(counts(a), counts(b))


@pytest.mark.parametrize(
    "probs",
    [
        [0.5, 0.3, 0.15, 0.05],
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0],
        [0.25, 0.0, 0.25, 0.5],
        [1e-3] * 1000,
    ],
)
def test_draw_samples_each_token_with_its_probability(probs):
    p = torch.tensor([probs]) / sum(probs)
    n = 100_000
    tokens = draw(p.expand(n, -1), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=p.shape[1]).float() / n
    sigma = (p[0] * (1 - p[0]) / n).sqrt()
    assert ((freq - p[0]).abs() <= 5 * sigma + 1e-9).all()
    assert (freq[p[0] == 0] == 0).all()


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 10, 1.0), (0.8, 0, 0.9)]
)
def test_sampler_logprobs_are_those_of_the_distribution_drawn_from(tiny, temperature, top_k, top_p):
    """The samplers' log-prob contract: each sampled token's log-prob under the distribution it
    was drawn from (tempered, then truncated). The trainer's replay of that distribution
    (TokenScores.behaviour) equals it; without truncation it is the trainer's own log-prob, so the
    ratio is 1 before any update (ref 000.1, 000.4); with truncation the sampler's is the larger
    (the kept mass renormalised)."""
    model, tok = tiny
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    torch.manual_seed(0)
    r = sample(
        model,
        prompts,
        num_generations=2,
        max_new_tokens=8,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
    )
    scorer = logprobs_mod.TokenLogprobs(
        model, temperature=temperature, shared_prompt=True, top_k=top_k, top_p=top_p
    )
    with torch.no_grad():
        scores = scorer(*r.inputs(), num_generations=r.num_generations)
    valid = r.trained_mask.bool()
    assert valid.sum() > 0
    torch.testing.assert_close(scores.behaviour[valid], r.sampler_logps[valid], atol=1e-4, rtol=1e-4)
    if top_k or top_p < 1:
        assert bool((scores.logps[valid] < r.sampler_logps[valid] - 1e-3).any())  # some mass was cut
        assert bool((scores.logps[valid] <= r.sampler_logps[valid] + 1e-5).all())
    else:
        torch.testing.assert_close(scores.logps[valid], r.sampler_logps[valid], atol=1e-4, rtol=1e-4)


def test_completion_mask_stops_after_first_eos_and_flags_truncation():
    """A toy model that emits EOS at a chosen step per row: mask covers tokens up to and
    including the first EOS; rows without EOS are truncated."""

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.calls = 0

        def forward(self, input_ids, past_key_values=None, **kw):
            from types import SimpleNamespace

            V, eos = 10, 9
            n, L = input_ids.shape
            logits = torch.full((n, 1, V), -1e4)
            # row 0 emits EOS at step 1, row 1 never; other tokens: 3
            step = self.calls
            self.calls += 1
            tok = torch.tensor([eos if step == 1 else 3, 3])
            logits[torch.arange(n), 0, tok] = 0.0
            return SimpleNamespace(logits=logits)

    r = sample(
        Toy(),
        [[1, 2], [1]],
        num_generations=1,
        max_new_tokens=4,
        temperature=1.0,
        greedy=True,
        eos_ids=[9],
        pad_id=0,
    )
    assert r.attention_mask.tolist() == r.trained_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert r.truncated.tolist() == [False, True]
    assert r.completion_ids[0].tolist() == [3, 9, 0, 0]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert not torch.isinf(filter_logits(logits, 0, 1.0)).any()


@pytest.mark.parametrize("shape", [(1, 8), (8, 8), (3, 1, 8), (2, 5, 8), (70, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_few_rows_linear_equals_linear_and_is_removed_after(shape, bias):
    from grpo_cli.samplers.builtin import few_rows_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 300, bias=bias), torch.nn.ReLU(), torch.nn.Linear(300, 4, bias=bias)
    )
    x = torch.randn(*shape)
    expected = model(x)
    with few_rows_linears(model):
        assert "forward" in model[0].__dict__
        got = model(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert all("forward" not in m.__dict__ for m in model.modules())
