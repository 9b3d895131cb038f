"""Numerics of the sampler: the inverse-CDF draw is exact on a large vocabulary, and the decode
fast path (_few_rows_linear, few_rows_linears) behaves like nn.Linear."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from grpo_cli.samplers.builtin import _few_rows_linear, draw, few_rows_linears, sampling_cdf

QWEN_VOCAB = 151_936


def _peaked_zipf_probs(rows: int, V: int = QWEN_VOCAB, seed: int = 0) -> torch.Tensor:
    """Rows like an LM's next-token distribution: Zipf-like tail over a shuffled vocabulary, a
    few tokens holding most of the mass; float32, as softmax returns it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        rank = torch.arange(1, V + 1, dtype=torch.float64)
        logits = -(1.0 + 0.1 * r) * rank.log()  # p ~ rank^-s
        logits[: r + 1] += 4.0  # a peak of r + 1 tokens
        logits = logits[torch.randperm(V, generator=g)]
        out.append(logits.float().softmax(-1))
    return torch.stack(out)  # [rows, V]


def _implied_probs(cdf: torch.Tensor) -> torch.Tensor:
    """Per-token masses a search over cdf draws with: the width of each token's interval."""
    cdf = cdf.double()
    return torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[:, :1])) / cdf[:, -1:]  # [N, V]


def _total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)  # [N]


def test_sampling_cdf_implies_the_exact_distribution_on_a_qwen_sized_vocabulary():
    probs = _peaked_zipf_probs(rows=4)
    exact = probs.double() / probs.double().sum(-1, keepdim=True)  # [N, V]
    tv = _total_variation(_implied_probs(sampling_cdf(probs)), exact)
    assert (tv < 1e-6).all(), tv
    # The test has power: the old float32 running sum is ~1e-4..1e-3 away on the same rows.
    tv32 = _total_variation(_implied_probs(probs.cumsum(-1)), exact)
    assert (tv32 > 1e-4).all(), tv32


def test_a_tiny_token_after_most_of_the_mass_is_drawn_in_its_exact_interval():
    k = 150_000
    probs = _peaked_zipf_probs(rows=1)[0]
    probs[k:] = 0.0
    probs[k] = 1e-8 * float(probs.sum())  # ~1e-8 of the mass, after all the rest
    probs = probs[None]  # [1, V]
    exact = probs.double().cumsum(-1) / probs.double().sum()  # [1, V]
    lo, hi = float(exact[0, k - 1]), float(exact[0, k])
    for frac in (0.01, 0.5, 0.99):
        u = torch.tensor([[lo + frac * (hi - lo)]], dtype=torch.float64)
        assert int(draw(probs, u=u)) == k
    assert int(draw(probs, u=torch.tensor([[lo - 1e-12]], dtype=torch.float64))) < k
    # The test has power: in float32 the token adds nothing to the running sum (never drawn).
    cdf32 = probs.cumsum(-1)
    assert cdf32[0, k] == cdf32[0, k - 1]


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.tensor(
        [
            [0.0, 0.2, 0.0, 0.0, 0.3, 0.5, 0.0],
            [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
            [0.25, 0.0, 0.25, 0.0, 0.0, 0.0, 0.5],
        ]
    )
    cdf = sampling_cdf(probs)  # [3, 7]
    # Every boundary of every row (where a search is most fragile), 0 and the largest u < 1.
    u_edges = torch.cat(
        [
            torch.zeros(3, 1, dtype=torch.float64),
            cdf / cdf[:, -1:],
            torch.full((3, 1), 1 - 2.0**-53, dtype=torch.float64),
        ],
        1,
    )  # [3, 9]
    for j in range(u_edges.shape[1]):
        tokens = draw(probs, u=u_edges[:, j : j + 1])
        assert (probs[torch.arange(3), tokens] > 0).all(), (j, tokens)
    tokens = draw(probs.repeat(2000, 1), torch.Generator().manual_seed(0))
    assert (probs.repeat(2000, 1)[torch.arange(6000), tokens] > 0).all()


def test_draw_in_chunks_equals_one_search_over_the_whole_batch():
    """draw splits a large batch into row chunks on the CPU: same tokens as one search."""
    probs = _peaked_zipf_probs(rows=9)  # > 1 chunk at this vocabulary size
    u = torch.rand(9, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cdf = sampling_cdf(probs)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    assert torch.equal(draw(probs, u=u), expected)


# ----------------------------------------------------------------------------- _few_rows_linear


def _layers(bias: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(64, 300, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "weight_dtype,input_dtype,autocast",
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float32, torch.float32, True),
        (torch.bfloat16, torch.float32, True),
        (torch.bfloat16, torch.bfloat16, True),
    ],
)
@pytest.mark.parametrize("shape", [(1, 64), (3, 1, 64)])
def test_few_rows_linear_matches_linear_dtype_and_values(bias, weight_dtype, input_dtype, autocast, shape):
    layer = _layers(bias, weight_dtype)
    x = torch.randn(*shape).to(input_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = F.linear(x, layer.weight, layer.bias)
        got = _few_rows_linear(layer, x)
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.is_contiguous()
    low = expected.dtype == torch.bfloat16
    # bf16: one rounding of the output (2^-8 relative), plus accumulation-order differences.
    torch.testing.assert_close(
        got.float(), expected.float(), atol=2e-2 if low else 1e-5, rtol=1e-2 if low else 1e-5
    )


# ----------------------------------------------------------------------------- few_rows_linears


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _patched(model) -> list[bool]:
    return ["forward" in m.__dict__ for m in model if isinstance(m, torch.nn.Linear)]


def test_nested_blocks_keep_the_patch_until_the_last_exit():
    model = _model()
    outer, inner = few_rows_linears(model), few_rows_linears(model)
    with outer:
        with inner:
            assert _patched(model) == [True, True]
        assert _patched(model) == [True, True]  # the inner exit must not unpatch the outer's layers
        with outer:  # the same object re-entered
            pass
        assert _patched(model) == [True, True]
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_overlapping_blocks_and_a_block_on_a_submodule():
    model = _model()
    a, b, head = few_rows_linears(model), few_rows_linears(model), few_rows_linears(model[2])
    a.__enter__()
    head.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first in is the first out: b still runs
    assert _patched(model) == [True, True]
    b.__exit__(None, None, None)
    assert _patched(model) == [False, True]  # head's block still holds the last layer
    head.__exit__(None, None, None)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_user_patched_forward_is_left_alone():
    model = _model()
    custom = lambda x: x  # noqa: E731
    model[0].forward = custom
    with few_rows_linears(model):
        assert model[0].forward is custom
    assert model[0].forward is custom and "forward" not in model[2].__dict__


def test_threads_sampling_one_model_at_once():
    model = _model()
    x = torch.randn(2, 8)
    expected = model(x)
    inside, start = threading.Barrier(4, timeout=60), threading.Barrier(4, timeout=60)
    errors = []

    def worker(i):
        try:
            start.wait()
            for _ in range(50):
                with few_rows_linears(model):
                    assert _patched(model) == [True, True]
                    torch.testing.assert_close(model(x), expected)
            with few_rows_linears(model):
                inside.wait()  # all four inside at once
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all("forward" not in m.__dict__ for m in model.modules())
