"""Models whose layers keep a recurrent or convolution state beside attention (the matrix's hybrids:
Qwen3.5, LFM2, Granite 4.0 hybrid) on the paths where a state could leak what attention's mask hides:
left padding, neighbours' lengths in a batch or a length bucket, pads fed after a row ended, and
completion holes. Each row must get what it gets alone. Proven in float64, where the only
difference left is summation order (~1e-15): fp32 rounding (~1e-6) would blur a small leak. The
models' logits are compared at 1e-10; log-probs, which the sampler and the scorer take in fp32
from those logits, at 1e-6.
The equalities with a textbook forward, greedy decoding against generate() and a short training
run are the matrix's (tests/test_architectures.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_architectures import HYBRIDS, V, archs, build

from grpo_cli.logprobs import ScoringOptions, length_buckets, row_lengths, score_tokens  # noqa: I001
from grpo_cli.logprobs import forward as forward_module
from grpo_cli.samplers.builtin import left_pad, sample

NAMES = archs(list(HYBRIDS))
SAMPLING = archs(list(HYBRIDS), sampling=True)


TIGHT = dict(atol=1e-10, rtol=0)  # float64 logits: summation order only
FP32 = dict(atol=1e-6, rtol=0)  # fp32 log-probs of float64 logits


def _alone_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The logits that score the completion's tokens, from its own unpadded sequence [C, V]."""
    ids = torch.tensor([prompt + completion])
    return model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


def _alone(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's log-probs from its own unpadded sequence [C]."""
    logp = _alone_logits(model, prompt, completion).log_softmax(-1)  # [C, V]
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _logits(model, tensors, buckets: bool) -> torch.Tensor:
    """The training forward's logits [B, C, V] (float64: no log-softmax yet), in length buckets or not."""
    b = length_buckets(row_lengths(tensors[3])) if buckets else None
    return forward_module._forward_logits(model, *tensors, 1, 1.0, b)


def _rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    completions = [torch.randint(3, V, (n,), generator=g).tolist() for n in (11, 2, 7, 4)]
    return prompts, completions


def _tensors(prompts, completions):
    p_ids, p_mask = left_pad(prompts, 0, "cpu")
    C = max(map(len, completions))
    c_ids = torch.zeros(len(completions), C, dtype=torch.long)
    c_mask = torch.zeros_like(c_ids)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)], c_mask[i, : len(c)] = torch.tensor(c), 1
    return p_ids, p_mask, c_ids, c_mask


@pytest.mark.parametrize("buckets", [False, True], ids=["one-pass", "length-buckets"])
@pytest.mark.parametrize("name", NAMES)
def test_a_rows_logprobs_do_not_depend_on_its_neighbours(name, buckets, monkeypatch):
    """Rows of other prompt and completion lengths share a left-padded batch (or length buckets,
    each with its own padding): each row's log-probs equal its own unpadded forward, and changing
    one row's tokens leaves the others bit for bit."""
    monkeypatch.setattr(forward_module, "BUCKET_OVERHEAD_TOKENS", 0)  # (a bucket per length)
    model = build(name).double().eval()
    prompts, completions = _rows(3)
    tensors = _tensors(prompts, completions)
    with torch.no_grad():
        logits = _logits(model, tensors, buckets)  # [4, C, V]
        for i, (p, c) in enumerate(zip(prompts, completions)):
            torch.testing.assert_close(logits[i, : len(c)], _alone_logits(model, p, c), **TIGHT)
        changed = tensors[2].clone()
        changed[1, :2] = (changed[1, :2] + 7) % V
        after = _logits(model, (*tensors[:2], changed, tensors[3]), buckets)
    assert torch.equal(after[[0, 2, 3]], logits[[0, 2, 3]])


@pytest.mark.parametrize("name", NAMES)
def test_a_completion_with_holes_is_scored_as_its_attended_tokens_alone(name, monkeypatch):
    """A hole (a completion token the model does not see) is masked out of attention, but a recurrent
    state still decays over it: the row's attended tokens are moved together before the forward, so
    the log-probs equal the row without its holes. Without that (the rows run as they are) they do
    not: the leak this guards against."""
    model = build(name).double().eval()
    prompts, completions = _rows(4)
    p_ids, p_mask, c_ids, c_mask = _tensors(prompts, completions)
    c_mask[0, [2, 3, 6]] = 0  # holes in row 0 (11 tokens)
    c_mask[2, 1] = 0  # and row 2
    kept = [[t for t, m in zip(c_ids[i].tolist(), c_mask[i].tolist()) if m] for i in range(4)]
    tensors = (p_ids, p_mask, c_ids, c_mask)
    with torch.no_grad():
        logits = _logits(model, tensors, False)
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i][c_mask[i].bool()], _alone_logits(model, p, kept[i]), **TIGHT)
        monkeypatch.setattr(forward_module, "_recurrent", lambda model: False)
        as_is = _logits(model, tensors, False)
    late = c_mask[0].bool().clone()
    late[:7] = False  # row 0's tokens after its last hole
    assert float((as_is[0][late] - logits[0][late]).abs().max()) > 1e-6


@pytest.mark.parametrize("name", SAMPLING)
def test_sampled_rows_do_not_depend_on_the_rows_beside_them(name):
    """A batch whose rows end at different steps (several end-of-sequence ids) and prompts of other
    lengths: each prompt's draws and log-probs equal those of the prompt sampled alone with its seed,
    and equal the training forward's log-probs of what was drawn."""
    model = build(name).double().eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (4, 10, 7)]
    kw = dict(num_generations=2, max_new_tokens=10, temperature=1.0, eos_ids=list(range(3, 23)), pad_id=0)
    batch = sample(model, prompts, seeds=[11, 12, 13], **kw)
    lengths = batch.attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 2  # (rows did end at different steps)
    for b, p in enumerate(prompts):
        alone = sample(model, [p], seeds=[11 + b], **kw)
        rows = [2 * b, 2 * b + 1]
        C = alone.completion_ids.shape[1]
        assert torch.equal(batch.completion_ids[rows, :C], alone.completion_ids)
        torch.testing.assert_close(batch.sampler_logps[rows, :C], alone.sampler_logps, **FP32)
    with torch.no_grad():
        scored = score_tokens(model, *batch.inputs(), ScoringOptions(1.0, chunk_size=0), 2).logps
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(scored[mask], batch.sampler_logps[mask], **FP32)


@pytest.mark.parametrize("name", SAMPLING)
def test_a_multi_turn_session_reads_each_rows_history_again(name, capsys):
    """The built-in sampler's multi-turn session on a hybrid reads every row's history again each
    turn (its cache was fed pads after a row ended): the turns' log-probs equal the training
    forward's over the whole episode (an environment's reply between turns)."""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.precision import resolve_precision
    from grpo_cli.samplers import Reprefill, Turn
    from grpo_cli.samplers.builtin import BuiltinSampler

    model = build(name).double().eval()
    s = BuiltinSampler(
        SamplerConfig(max_new_tokens=4),
        model,
        eos_ids=[2],
        pad_id=0,
        precision=resolve_precision("fp32", torch.device("cpu")),
        fast_decode=True,
    )
    prompts, G = [[5, 6, 7, 8, 9], [10, 11]], 2
    session = s.session(prompts, G)
    assert isinstance(session, Reprefill)
    rows = list(range(len(prompts) * G))
    histories, sampled = [[] for _ in rows], [[] for _ in rows]  # each row's tokens; which it drew
    reply = [40, 41, 42]
    for turn in range(2):
        seeds = [7, 8] if turn == 0 else [100 + n for n in rows]
        drawn = session.turn(rows, histories, Turn(seeds, False, True, 4, []))
        for n, (tokens, logps) in enumerate(drawn):
            sampled[n] += [(len(histories[n]) + k, lp) for k, lp in enumerate(logps)]
            histories[n] += tokens + (reply if turn == 0 else [])
    for n in rows:
        want = _alone(model, prompts[n // G], histories[n])
        got = torch.tensor([lp for _, lp in sampled[n]], dtype=torch.float64)
        torch.testing.assert_close(got, want[[k for k, _ in sampled[n]]], **FP32)


def test_an_attention_model_keeps_its_kv_cache_session():
    """(The re-reading is for the hybrids only: an attention model's session keeps its cache.)"""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.precision import resolve_precision
    from grpo_cli.samplers.builtin import BuiltinSampler, Session

    model = build("llama").eval()
    s = BuiltinSampler(
        SamplerConfig(max_new_tokens=4),
        model,
        eos_ids=[2],
        pad_id=0,
        precision=resolve_precision("fp32", torch.device("cpu")),
        fast_decode=True,
    )
    assert isinstance(s.session([[5, 6]], 2), Session)


def test_a_qwen3_5_checkpoint_as_published_loads_as_its_text_model(tmp_path):
    """Qwen3.5's checkpoints are image-text models (model_type qwen3_5, a vision tower beside the text
    model): AutoModelForCausalLM loads their text part (qwen3_5_text), which the matrix tests."""
    if not hasattr(tf, "Qwen3_5ForConditionalGeneration"):
        pytest.skip(f"transformers {tf.__version__} has no qwen3_5")
    from grpo_cli.models import recurrent, tested_architecture

    text = build("qwen3_5").config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    tf.Qwen3_5ForConditionalGeneration(
        tf.Qwen3_5Config(text_config=text, vision_config=vision)
    ).save_pretrained(tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.model_type == "qwen3_5_text"
    assert recurrent(model) and tested_architecture(model)


UNTESTED = {  # recurrent types outside the matrix: the plain paths, the self-check as the guard
    "jamba": lambda: tf.JambaForCausalLM(
        tf.JambaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
            use_mamba_kernels=False,  # (transformers 4.x: its CUDA kernels otherwise)
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    ),
    "mamba": lambda: tf.MambaForCausalLM(
        tf.MambaConfig(
            vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2, pad_token_id=0, eos_token_id=2
        )
    ),
}


@pytest.mark.parametrize("name", list(UNTESTED))
def test_a_recurrent_model_outside_the_matrix_trains_or_is_stopped_in_one_paragraph(
    name, compose, tmp_path, capsys
):
    """Jamba (Mamba and attention) trains through the plain paths with the recurrent measures; Mamba's
    decode in transformers 5 needs what the sampler does not pass (its log-probs then disagree with
    the training forward's by ~0.1): the step-0 self-check stops the run in one paragraph; in
    transformers 4.x its forward returns no cache, refused in one paragraph at the first prefill.
    Never a traceback or a silently wrong run."""
    from grpo_cli.cli.train import train_config
    from grpo_cli.errors import UserError
    from grpo_cli.models import build_tiny
    from grpo_cli.selfcheck import SelfCheckError

    torch.manual_seed(0)
    UNTESTED[name]().save_pretrained(tmp_path / name, safe_serialization=True)
    cfg = compose(
        [
            "model=tiny",
            f"model.name_or_path={tmp_path / name}",
            f"model.tokenizer={build_tiny()}",
            "data.num_examples=16",
            "data.eval_size=0",
            "sampler.num_generations=4",
            "sampler.max_new_tokens=6",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "reward=[length]",
            "reward.length.unit=chars",
            "reward.length.target=4",
        ]
    )
    if name == "mamba" or int(tf.__version__.split(".")[0]) < 5:  # (4.x's Jamba builds no cache either)
        with pytest.raises((SelfCheckError, UserError), match="step-0 self-check failed|returned no cache"):
            train_config(cfg, tmp_path)
        return
    row = train_config(cfg, tmp_path)
    out = capsys.readouterr().out.replace("\n", " ")
    assert row["step"] == 2 and "self-check ok" in out
    assert f"model type {name!r} keeps a recurrent or convolution state" in out


def test_a_model_that_builds_no_cache_of_its_own_is_refused_in_one_paragraph():
    """transformers 4.x's GraniteMoeHybrid (and any model whose forward returns no cache): the first
    prefill stops in one paragraph naming the model type and what it lacks."""
    from test_architectures import _samples

    from grpo_cli.errors import UserError

    if _samples("granitemoehybrid"):
        pytest.skip(f"transformers {tf.__version__}'s granitemoehybrid builds its own cache")
    with pytest.raises(UserError, match="'granitemoehybrid': its forward returned no cache"):
        sample(
            build("granitemoehybrid").eval(),
            [[5, 6]],
            num_generations=2,
            max_new_tokens=3,
            temperature=1.0,
            eos_ids=[],
            pad_id=0,
        )
