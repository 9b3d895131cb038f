"""Log-probs from the final hidden states, a chunk of tokens' logits at a time (the default path,
trainer.logprob_chunk_size): the same log-probs, entropies and gradients as the model's whole
logits (logprob_chunk_size=0), on every architecture of the matrix, with LoRA on the output layer
and with gradient checkpointing; no [B, C, V] tensor while it runs."""

from __future__ import annotations

import pytest
import torch
from test_architectures import COMPLETION_LENGTHS, HYBRIDS, G, archs, batch, build

from grpo_cli.logprobs import ScoringOptions, chunkable, score_tokens


def _scores(model, tensors, chunk_size, *, shared=True, top_p=1.0):
    options = ScoringOptions(0.7, with_entropy=True, top_p=top_p, chunk_size=chunk_size)
    return score_tokens(model, *tensors, options, G if shared else 1)


def _assert_same_grads(names, ours, theirs, rtol=1e-6, per_tensor_rtol=4e-6):
    """Gradients equal to rtol in all, and to per_tensor_rtol tensor by tensor: the fp32 whole
    path is itself that far from float64 on a small tensor (Qwen3's k_norm: 1.5e-6, and the
    chunked path 1.7e-6: each rounds its sums in another order). A tensor whose true gradient is
    0 (a key bias: softmax ignores a shift of every score alike) is float noise on both sides,
    held to a floor instead."""
    pairs = [(n, a, b) for n, a, b in zip(names, ours, theirs) if b is not None]
    assert all(a is not None for _, a, _ in pairs)
    total = float(torch.cat([b.flatten() for _, _, b in pairs]).norm())
    diff = float(torch.cat([(a - b).flatten() for _, a, b in pairs]).norm())
    assert diff <= rtol * total, (diff, total)
    floor = 1e-2 * total / len(pairs) ** 0.5
    for n, a, b in pairs:
        assert float((a - b).norm()) <= per_tensor_rtol * max(float(b.norm()), floor), n


# Equalities that hold only up to summation order (length buckets, a prefix run once: other
# shapes, so other sums) run the model in float64: in fp32 a CPU's vector units change the order
# and the drift through the layers (6.2e-6 on an AVX512-BF16 EPYC, issue #58). In float64 the
# hidden states agree to ~1e-15 on any CPU; what is left is the scorer's log-softmax, which runs in
# fp32 (the logits cast to fp32, as for bf16 models): within a few fp32 ulps, so 1e-6, measured
# 4e-8 relative on the gradients. Gemma 2/3 stay fp32 (at 2e-6, as before): their sliding-window
# masks give NaN in float64 under buckets (float64 is not a training dtype).
LOOSE = dict(rtol=1e-6, atol=2e-6)


def _model64(name: str):
    """The arch's tiny model for a summation-order equality: float64 where it runs in float64."""
    model = build(name).train()
    return model if name in ("gemma2", "gemma3") else model.double()


def _grads(model, tensors, chunk_size, weights, shared=True):
    scores = _scores(model, tensors, chunk_size, shared=shared)
    mask = tensors[3].float()
    loss = (scores.logps * mask * weights[:, None]).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return scores, torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "plain"])
@pytest.mark.parametrize("name", archs())
def test_chunked_logprobs_and_gradients_equal_the_whole_logits(name, shared):
    """Chunks of 5 tokens (several per row, a row split across chunks) against the model's whole
    logits: log-probs, entropies and every parameter's gradient to 1e-6 relative (fp32). The
    hybrids run in float64: the head's gradient, equal to fp32 rounding, reaches their recurrent
    layers, whose fp32 scans amplify the order of its sums (Qwen3.5's in_proj_a: 5e-6 of its
    norm with two threads, within 1e-6 with one: not a property of the chunking)."""
    model = build(name).train()
    model = model.double() if name in HYBRIDS else model
    assert chunkable(model), name
    _, _, tensors = batch(shared)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    chunked, ours = _grads(model, tensors, 5, weights, shared)
    whole, theirs = _grads(model, tensors, 0, weights, shared)
    mask = tensors[3].bool()
    torch.testing.assert_close(chunked.logps[mask], whole.logps[mask], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked.entropy[mask], whole.entropy[mask], rtol=1e-6, atol=1e-6)
    _assert_same_grads([n for n, _ in model.named_parameters()], ours, theirs)


@pytest.mark.parametrize("chunk_size", [None, 0], ids=["chunked", "whole"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "plain"])
@pytest.mark.parametrize("name", archs())
def test_length_buckets_give_the_same_scores_and_gradients(name, shared, chunk_size, monkeypatch):
    """Rows run in length buckets (trainer.micro_batch_tokens: ScoringOptions.length_buckets), here a
    bucket per length (4 passes over 6 rows, under the shared prompts' KV cache or as full rows),
    and the chunked output layer scoring only the columns within each row's length: the same
    log-probs, entropies and gradients as one pass over the padded rows (float64 where it runs: LOOSE)."""
    from dataclasses import replace

    from grpo_cli.logprobs import forward, length_buckets, row_lengths

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)
    model = _model64(name)
    _, _, tensors = batch(shared)
    assert len(length_buckets(row_lengths(tensors[3]))) == len(set(COMPLETION_LENGTHS))
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0], dtype=next(model.parameters()).dtype)
    options = ScoringOptions(0.7, with_entropy=True, chunk_size=chunk_size)
    params = list(model.parameters())
    results = []
    for opts in (options, replace(options, length_buckets=True)):
        scores = score_tokens(model, *tensors, opts, G if shared else 1)
        loss = (scores.logps * tensors[3] * weights[:, None]).sum()
        results.append((scores, torch.autograd.grad(loss, params, allow_unused=True)))
    (one, ours), (bucketed, theirs) = results
    mask = tensors[3].bool()
    torch.testing.assert_close(bucketed.logps[mask], one.logps[mask], **LOOSE)
    torch.testing.assert_close(bucketed.entropy[mask], one.entropy[mask], **LOOSE)
    _assert_same_grads([n for n, _ in model.named_parameters()], theirs, ours)


def test_truncated_sampling_scores_equal_the_whole_logits():
    model = build("llama").eval()
    _, _, tensors = batch(True)
    with torch.no_grad():
        chunked = _scores(model, tensors, 4, top_p=0.8)
        whole = _scores(model, tensors, 0, top_p=0.8)
    mask = tensors[3].bool()
    torch.testing.assert_close(chunked.behaviour[mask], whole.behaviour[mask], rtol=1e-6, atol=1e-6)
    assert (chunked.behaviour[mask] >= chunked.logps[mask] - 1e-6).all()  # (a truncated distribution)


def test_lora_on_the_output_layer_gets_the_same_gradients_chunked():
    from peft import LoraConfig, get_peft_model

    model = build("qwen2")
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    )
    with torch.no_grad():  # non-zero B matrices: the adapters change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.train()
    assert chunkable(model)
    _, _, tensors = batch(True)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    _, ours = _grads(model, tensors, 3, weights)
    _, theirs = _grads(model, tensors, 0, weights)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n in names)
    _assert_same_grads(names, ours, theirs)


def test_gradient_checkpointing_gives_the_same_gradients_chunked():
    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, _, tensors = batch(False)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    _, ours = _grads(model, tensors, 7, weights, shared=False)
    _, theirs = _grads(model, tensors, 0, weights, shared=False)
    _assert_same_grads([n for n, _ in model.named_parameters()], ours, theirs)


def test_no_tensor_of_the_whole_vocabulary_per_token_is_made():
    """Of the tensors of logits the forward and backward make (saved for the backward or not),
    none is larger than one chunk's [chunk, V] logits, where the whole path makes [B, C, V]: a row
    of V per token, or in the output layer's backward a slice of the vocabulary's columns for every
    token ([N, v]: flat, N = B * C rows, not the hidden states' H)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = slices = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if not isinstance(t, torch.Tensor) or not t.dim() or t.numel() == V * H:
                    continue  # (not the output layer's weight or its gradient, [V, H])
                if t.shape[-1] == V:
                    Largest.largest = max(Largest.largest, t.numel())
                elif t.dim() == 2 and t.shape[0] == B * C and t.shape[1] != H:
                    Largest.slices = max(Largest.slices, t.numel())
            return out

    model = build("llama").train()
    _, _, tensors = batch(True)
    B, C = tensors[2].shape
    V, H = model.config.vocab_size, model.config.hidden_size
    weights = torch.ones(B)
    for chunk, bound in ((4, 4 * V), (0, B * C * V)):
        Largest.largest = Largest.slices = 0
        with Largest():
            _grads(model, tensors, chunk, weights)
        assert Largest.largest == bound, (chunk, Largest.largest, bound)
        if chunk:  # the output layer's backward: slices of 4 * V // (B * C) columns
            assert 0 < Largest.slices <= bound, (Largest.slices, bound)


def test_grpo_train_with_chunked_logprobs_takes_the_steps_of_the_whole_logits(tmp_path):
    """A tiny run with trainer.logprob_chunk_size=3 (the policy, the reference at beta 0.04 and
    the self-check all chunked) logs what the whole-logits run logs, step for step (fp32)."""
    import json

    from conftest import grpo, tiny

    rows = {}
    for chunk in ("0", "3"):
        run = tmp_path / f"chunk{chunk}"
        args = tiny(
            "trainer.precision=fp32",
            "loss.beta=0.04",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "trainer.eval_before=false",
            "data.eval_size=0",
            f"trainer.logprob_chunk_size={chunk}",
            f"hydra.run.dir={run}",
        )
        res = grpo(args, tmp_path)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "self-check ok" in res.stdout or "self-check" not in res.stdout
        rows[chunk] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "kl", "entropy", "reward", "grad_norm")
    assert len(rows["0"]) == len(rows["3"]) == 2
    for a, b in zip(rows["0"], rows["3"]):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize(
    "bias, softcap, temperature, top_p",
    [
        (False, None, 1.0, 1.0),
        (True, None, 0.7, 1.0),
        (False, 3.0, 1.0, 0.9),
        (True, 3.0, 1.3, 1.0),
    ],
)
def test_the_output_layers_own_backward_gives_autograds_gradients(bias, softcap, temperature, top_p):
    """_LinearHeadScores (a plain Linear output layer's hand-written backward) against autograd
    through the whole logits: log-probs, entropies, the sampler's truncated log-probs, and the
    gradients to the hidden states, the weight and the bias, with a temperature and a soft-capping
    (Gemma2's final_logit_softcapping), chunks of 3 tokens of 2 x 5 (fp32, 1e-6)."""
    from grpo_cli.logprobs import OutputLayer, chunked_scores, token_scores

    torch.manual_seed(0)
    V, H = 50, 16
    head = torch.nn.Linear(H, V, bias=bias)
    out = OutputLayer(head, softcap)
    hidden = torch.randn(2, 5, H, requires_grad=True)
    targets = torch.randint(0, V, (2, 5))
    weights = torch.randn(2, 5)
    params = [hidden, head.weight] + ([head.bias] if bias else [])
    kw = dict(temperature=temperature, with_entropy=True, top_p=top_p)

    options = ScoringOptions(**kw)
    ours = chunked_scores(out, hidden, targets, options, chunk=3)
    g_ours = torch.autograd.grad((ours.logps * weights).sum(), params)
    theirs = token_scores(out.logits(hidden) / temperature, targets, **{**kw, "temperature": 1.0})
    g_theirs = torch.autograd.grad((theirs.logps * weights).sum(), params)
    for a, b in (
        (ours.logps, theirs.logps),
        (ours.entropy, theirs.entropy),
        (ours.behaviour, theirs.behaviour),
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the reference pass's path: no backward kept, the same numbers
        torch.testing.assert_close(
            chunked_scores(out, hidden, targets, options, chunk=3).logps, ours.logps.detach()
        )


def test_bf16_autocast_chunked_is_within_bf16_noise_of_the_whole_logits():
    """Under bf16 autocast both paths run the output layer's matmuls in bf16 and the log-softmax in
    fp32, rounding in other places (a chunk's matmul, the gradient scaled after it). Measured here:
    log-probs 0.003-0.006 apart (|log p| up to 6), gradients 0.6-0.8% apart, while each path's
    gradient is 0.8-1.6% from the fp32 one. Asserted: the log-prob gap within bf16's 2^-7 of the
    largest, and the chunked gradient no farther from fp32 than 1.5x the whole path's own bf16 error."""
    model = build("qwen2").train()
    _, _, tensors = batch(True)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked, ours = _grads(model, tensors, 5, weights)
        whole, theirs = _grads(model, tensors, 0, weights)
    _, fp32 = _grads(model, tensors, 0, weights)
    mask = tensors[3].bool()
    gap = (chunked.logps - whole.logps)[mask].abs().max()
    assert gap <= 2**-7 * whole.logps[mask].abs().max(), gap

    def distance(grads, to):
        pairs = [(a, b) for a, b in zip(grads, to) if b is not None]
        return float(torch.cat([(a - b).flatten() for a, b in pairs]).float().norm())

    assert distance(ours, fp32) <= 1.5 * distance(theirs, fp32), (
        distance(ours, fp32),
        distance(theirs, fp32),
    )
    assert distance(ours, theirs) > 0  # bf16 did round (the check above is not fp32 against fp32)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_fsdp2_sharded_model_scores_chunked_with_the_whole_logits_gradients(name):
    """Two processes (torchrun, gloo), the model sharded by FSDP2 as trainer.distributed=fsdp
    shards it: the chunked path is taken (its output layer's weights are the root's, gathered
    from the forward to the backward) and gives an unsharded model's log-probs and gradients
    (tests/chunked_fsdp_helper.py; Llama's own output layer, Gemma2's tied one with soft-capping)."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import grpo_env

    helper = Path(__file__).resolve().parent / "chunked_fsdp_helper.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(helper),
        name,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=grpo_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert res.stdout.count("chunked under FSDP2 ok") == 2, res.stdout


# ----------------------------------------------------------------------------- the entropy's gradient


def _entropy_grads(model, tensors, chunk_size, weights, shared=True):
    """The gradient of a loss of the log-probs and the entropy together (the entropy bonus's
    shape), the entropy scored with its gradient (ScoringOptions.entropy_grad)."""
    options = ScoringOptions(0.7, entropy_grad=True, chunk_size=chunk_size)
    scores = score_tokens(model, *tensors, options, G if shared else 1)
    mask = tensors[3].float()
    loss = (scores.logps * mask * weights[:, None]).sum() - 0.3 * (scores.entropy * mask).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return scores, torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("name", archs())
def test_the_entropys_gradient_chunked_equals_the_whole_logits(name):
    """The entropy bonus needs d H / d theta: chunks of 5 tokens against the whole logits, every
    parameter's gradient of log-probs and entropy together to 1e-6 relative (fp32)."""
    model = build(name).train()
    _, _, tensors = batch(True)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    chunked, ours = _entropy_grads(model, tensors, 5, weights)
    whole, theirs = _entropy_grads(model, tensors, 0, weights)
    mask = tensors[3].bool()
    assert chunked.entropy.requires_grad and whole.entropy.requires_grad
    torch.testing.assert_close(chunked.entropy[mask], whole.entropy[mask], rtol=1e-6, atol=1e-6)
    _assert_same_grads([n for n, _ in model.named_parameters()], ours, theirs)


@pytest.mark.parametrize("bias, softcap, temperature", [(False, None, 1.0), (True, 3.0, 1.3)])
def test_the_output_layers_own_backward_gives_the_entropys_gradient(bias, softcap, temperature):
    """_LinearHeadScores with entropy_grad against autograd through the whole logits: the
    gradients of log-probs and entropy weighted apart, to the hidden states, weight and bias."""
    from grpo_cli.logprobs import OutputLayer, chunked_scores, token_scores

    torch.manual_seed(1)
    V, H = 50, 16
    head = torch.nn.Linear(H, V, bias=bias)
    out = OutputLayer(head, softcap)
    hidden = torch.randn(2, 5, H, requires_grad=True)
    targets = torch.randint(0, V, (2, 5))
    a, b = torch.randn(2, 5), torch.randn(2, 5)
    params = [hidden, head.weight] + ([head.bias] if bias else [])
    ours = chunked_scores(out, hidden, targets, ScoringOptions(temperature, entropy_grad=True), chunk=3)
    g_ours = torch.autograd.grad((ours.logps * a).sum() + (ours.entropy * b).sum(), params)
    theirs = token_scores(out.logits(hidden) / temperature, targets, temperature=1.0, entropy_grad=True)
    g_theirs = torch.autograd.grad((theirs.logps * a).sum() + (theirs.entropy * b).sum(), params)
    torch.testing.assert_close(ours.entropy, theirs.entropy, rtol=1e-6, atol=1e-6)
    for x, y in zip(g_ours, g_theirs):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    # Without entropy_grad the entropy is a monitored value: no gradient.
    plain = chunked_scores(out, hidden, targets, ScoringOptions(temperature, with_entropy=True), chunk=3)
    assert not plain.entropy.requires_grad


def test_lora_on_the_output_layer_gets_the_entropys_gradient_chunked():
    """The checkpointed chunk path (a LoRA-wrapped output layer) with the entropy's gradient."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.train()
    _, _, tensors = batch(True)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    _, ours = _entropy_grads(model, tensors, 3, weights)
    _, theirs = _entropy_grads(model, tensors, 0, weights)
    _assert_same_grads([n for n, p in model.named_parameters() if p.requires_grad], ours, theirs)


def test_length_buckets_replay_truncation_and_keep_the_entropys_gradient(monkeypatch):
    """Under length buckets, the sampler's truncated distribution (top_p) is replayed for the
    behaviour log-probs, and the entropy bonus's gradient flows, as in one pass."""
    from dataclasses import replace

    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)
    model = _model64("llama")
    _, _, tensors = batch(True)
    options = ScoringOptions(0.7, top_p=0.8, entropy_grad=True)
    params = list(model.parameters())
    results = []
    for opts in (options, replace(options, length_buckets=True)):
        scores = score_tokens(model, *tensors, opts, G)
        results.append((scores, torch.autograd.grad((scores.entropy * tensors[3]).sum(), params)))
    (one, ours), (bucketed, theirs) = results
    mask = tensors[3].bool()
    assert not torch.equal(one.behaviour[mask], one.logps[mask].detach())  # (top_p truncates here)
    torch.testing.assert_close(bucketed.behaviour[mask], one.behaviour[mask], **LOOSE)
    _assert_same_grads([n for n, _ in model.named_parameters()], theirs, ours)


@pytest.mark.parametrize("name", archs())
def test_a_prefix_every_prompt_shares_runs_once_with_the_same_scores_and_gradients(name, monkeypatch):
    """Under length buckets, the real tokens every prompt of a micro-batch begins with (a system
    prompt, tool instructions) run once for all its groups, each prompt's remainder after them at
    its own positions (left padding a hole between): the same log-probs and gradients as one pass
    (float64 where it runs: LOOSE), with one forward more than the groups' prompts alone (the prefix's)."""
    from dataclasses import replace

    from test_architectures import left_pad

    from grpo_cli.logprobs import forward

    monkeypatch.setattr(forward, "BUCKET_OVERHEAD_TOKENS", 0)
    model = _model64(name)
    rows, _, (_, _, c_ids, c_mask) = batch(True)
    prefix = [7, 8, 9, 10, 11, 12]
    p_ids, p_mask = left_pad([prefix + r for r in rows], 0, "cpu")
    tensors = (p_ids, p_mask, c_ids, c_mask)
    assert forward._common_prefix(p_ids[::G], p_mask[::G]) == len(prefix)
    calls = []
    real = forward.model_logits
    monkeypatch.setattr(
        forward,
        "model_logits",
        lambda *a, **k: calls.append(k.get("inputs_embeds", k.get("input_ids")).shape[:2]) or real(*a, **k),
    )
    weights = torch.linspace(-1.0, 1.0, c_ids.shape[0], dtype=next(model.parameters()).dtype)
    options = ScoringOptions(0.7, with_entropy=True)
    params = list(model.parameters())
    results = []
    for opts in (options, replace(options, length_buckets=True)):
        scores = score_tokens(model, *tensors, opts, G)
        loss = (scores.logps * c_mask * weights[:, None]).sum()
        results.append((scores, torch.autograd.grad(loss, params, allow_unused=True)))
    (one, ours), (bucketed, theirs) = results
    # the prefix, once (not under a sliding window narrower than the rows: it measures cache columns)
    # (not under a sliding window narrower than the rows, nor for the hybrids: no shared prompt)
    assert ((1, len(prefix)) in calls) == (name not in ("mistral", "gemma2", "gemma3", *HYBRIDS))
    mask = c_mask.bool()
    torch.testing.assert_close(bucketed.logps[mask], one.logps[mask], **LOOSE)
    _assert_same_grads([n for n, _ in model.named_parameters()], theirs, ours)
