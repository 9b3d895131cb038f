"""The architecture matrix: tiny random-init models built offline from transformers' own config
classes, one per family users train (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms,
Mistral and Gemma 2/3 with a sliding window shorter than the sequences, Gemma 2's logit
soft-capping, Phi-3's partial rotary, OLMo 2's norms, GPT-2, and OPT, which ignores
`logits_to_keep`), and three hybrids whose layers keep a recurrent or convolution state beside
attention (Qwen3.5's Gated DeltaNet, LFM2's short convolutions, Granite 4.0's Mamba-2 layers).
For each: the training log-probs (the shared-prompt KV-cache path and the
plain one) equal a textbook full-sequence forward, their gradients too, greedy decoding through
the rollout equals `generate()`, and a 2-step grpo-train run passes the step-0 self-check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from grpo_cli.logprobs import token_logprobs
from grpo_cli.models import build_tiny, disable_dropout
from grpo_cli.samplers.builtin import left_pad, sample

V = 103  # the built-in tiny tokenizer's vocabulary, so each model can also train with it
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    **IDS,
)
ARCHS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**DECODER)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**DECODER, head_dim=8)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**DECODER, sliding_window=8)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(
            **DECODER, head_dim=8, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0
        )
    ),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**DECODER, head_dim=8, sliding_window=8)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**DECODER, partial_rotary_factor=0.5)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**DECODER)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, **IDS)),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(
            vocab_size=V,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            **IDS,
        )
    ),
}
# The hybrids (models.RECURRENT_MODEL_TYPES): small heads, and layer kinds in the order their
# checkpoints mix them (attention after the recurrent layers it follows).
HYBRIDS = {
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(
        tf.Qwen3_5TextConfig(
            **DECODER | dict(num_hidden_layers=4),
            head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        )
    ),
    "lfm2": lambda: tf.Lfm2ForCausalLM(
        tf.Lfm2Config(**DECODER | dict(num_hidden_layers=4), layer_types=["conv", "full_attention"] * 2)
    ),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridForCausalLM(
        tf.GraniteMoeHybridConfig(
            **DECODER | dict(num_hidden_layers=3),
            layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_expand=2,
            mamba_d_conv=4,
            shared_intermediate_size=64,
            num_local_experts=0,
        )
    ),
}
# What each hybrid needs of transformers (the oldest supported release, 4.57, lacks some).
HYBRID_CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}
ARCHS.update(HYBRIDS)


def _available(name: str) -> bool:
    return name not in HYBRID_CLASSES or hasattr(tf, HYBRID_CLASSES[name])


# transformers 4.x's GraniteMoeHybrid returns no cache unless its HybridMambaAttentionDynamicCache is
# passed in: the built-in sampler refuses it there in one paragraph (test_hybrid_models), so the
# tests that sample skip it on those releases; its training forward is tested on every release.
OWN_CACHE_SINCE = {"granitemoehybrid": 5}


def _samples(name: str) -> bool:
    return int(tf.__version__.split(".")[0]) >= OWN_CACHE_SINCE.get(name, 0)


def archs(names=None, *, sampling: bool = False) -> list:
    """The matrix's names as test parameters, a hybrid this transformers release lacks skipped (and,
    for a test that samples, one whose model builds no cache of its own on this release)."""
    params = []
    for n in names or ARCHS:
        if not _available(n):
            marks = pytest.mark.skip(reason=f"transformers {tf.__version__} has no {HYBRID_CLASSES.get(n)}")
        elif sampling and not _samples(n):
            marks = pytest.mark.skip(
                reason=f"transformers {tf.__version__}'s {n} builds no cache of its own: refused in one paragraph"
            )
        else:
            marks = ()
        params.append(pytest.param(n, marks=marks))
    return params


G = 3
PROMPT_LENGTHS = (5, 11)  # left padding
COMPLETION_LENGTHS = (4, 9, 1, 13, 6, 2)  # 2 groups of G, right padding; prompt + completion > window 8


def build(name: str):
    torch.manual_seed(0)
    model = ARCHS[name]().float()
    with torch.no_grad():  # sharper than the init: mistakes (shift, padding) change the numbers visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    disable_dropout(model)
    return model


def batch(shared: bool):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    completions = [torch.randint(3, V, (n,), generator=g).tolist() for n in COMPLETION_LENGTHS]
    if shared:  # G completions per prompt, one group's rows consecutive: the KV-cache path
        rows = [prompts[i // G] for i in range(len(completions))]
    else:
        rows = [prompts[i % 2][: 3 + i] for i in range(len(completions))]  # every row its own prompt
    p_ids, p_mask = left_pad(rows, 0, "cpu")
    c_ids = torch.zeros(len(completions), max(COMPLETION_LENGTHS), dtype=torch.long)
    c_mask = torch.zeros_like(c_ids)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = 1
    return rows, completions, (p_ids, p_mask, c_ids, c_mask)


def reference(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """One unpadded sequence, full log_softmax, explicit shift: the textbook computation."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    logp = F.log_softmax(logits[:-1], dim=-1)  # position t predicts token t+1
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[-len(completion) :]  # [C]


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "plain"])
@pytest.mark.parametrize("temperature", [0.7, 2.0])
@pytest.mark.parametrize("name", archs())
def test_training_logprobs_equal_a_full_sequence_forward(name, temperature, shared):
    model = build(name).eval()
    rows, completions, tensors = batch(shared)
    with torch.no_grad():
        logps = token_logprobs(
            model, *tensors, temperature=temperature, num_generations=G if shared else 1
        )  # [B, C]
        for i, (p, c) in enumerate(zip(rows, completions)):
            torch.testing.assert_close(
                logps[i, : len(c)], reference(model, p, c, temperature), atol=1e-5, rtol=0
            )


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "plain"])
@pytest.mark.parametrize("name", archs())
def test_training_logprob_gradients_equal_a_full_sequence_forward(name, shared):
    """The shared-prompt path sends gradients back through the prompt's KV cache, and both paths
    divide the logits by the temperature in place: the same gradients as every row's own full
    forward (relative error < 1e-4)."""
    model = build(name).train()
    rows, completions, tensors = batch(shared=shared)
    weights = torch.linspace(-1.0, 1.0, len(completions))  # advantages of both signs
    logps = token_logprobs(model, *tensors, temperature=0.7, num_generations=G if shared else 1)
    loss = sum(w * logps[i, : len(c)].sum() for i, (w, c) in enumerate(zip(weights, completions)))
    ours = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    loss = sum(w * reference(model, p, c, 0.7).sum() for w, p, c in zip(weights, rows, completions))
    theirs = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    pairs = [(n, a, b) for (n, _), a, b in zip(model.named_parameters(), ours, theirs) if b is not None]
    assert all(a is not None for _, a, _ in pairs)
    flat_a, flat_b = (
        torch.cat([a.flatten() for _, a, _ in pairs]),
        torch.cat([b.flatten() for _, _, b in pairs]),
    )
    assert float((flat_a - flat_b).norm() / flat_b.norm()) < 1e-4
    # Per tensor too, against a floor: some true gradients are 0 (a key bias shifts every score of a
    # query alike, and softmax ignores that), where both sides are float noise.
    floor = 1e-3 * float(flat_b.norm()) / len(pairs) ** 0.5
    for pname, a, b in pairs:
        assert float((a - b).norm()) <= 1e-4 * max(float(b.norm()), floor), pname


@pytest.mark.parametrize("name", archs(sampling=True))
def test_greedy_rollout_equals_generate(name):
    """The decode loop (its own KV cache, the CPU W @ x^T layers, prompts of different lengths
    in one left-padded batch) picks generate()'s tokens."""
    model = build(name).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    out = sample(
        model,
        prompts,
        num_generations=2,
        max_new_tokens=12,
        temperature=1.0,
        eos_ids=[],
        pad_id=0,
        greedy=True,
    )
    for i, p in enumerate(prompts):
        want = model.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(p) :]
        for row in (2 * i, 2 * i + 1):
            assert out.completion_ids[row].tolist() == want.tolist(), (name, row)


@pytest.mark.parametrize("name", archs(sampling=True))
def test_two_step_grpo_train_passes_the_self_check(name, compose, tmp_path, capsys):
    from grpo_cli.cli.train import train_config

    folder = tmp_path / name
    build(name).save_pretrained(folder, safe_serialization=True)
    cfg = compose(
        [
            "model=tiny",
            f"model.name_or_path={folder}",
            f"model.tokenizer={build_tiny()}",
            "data.num_examples=32",
            "data.eval_size=0",
            "sampler.num_generations=4",
            "sampler.max_new_tokens=12",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "trainer.gradient_accumulation_steps=2",
            "loss.beta=0.04",
            "optimizer.learning_rate=1e-3",
            "reward=[length]",
            "reward.length.unit=chars",
            "reward.length.target=4",
        ]
    )
    row = train_config(cfg, tmp_path)
    assert row["step"] == 2 and row["ratio_max"] >= 1.0
    assert "self-check ok" in capsys.readouterr().out


def test_the_matrix_is_the_list_of_tested_model_types():
    from grpo_cli.models import TESTED_MODEL_TYPES

    missing = {build_type for n, build_type in _HYBRID_TYPES.items() if not _available(n)}
    assert sorted(build(name).config.model_type for name in ARCHS if _available(name)) == sorted(
        set(TESTED_MODEL_TYPES) - missing
    )


_HYBRID_TYPES = {"qwen3_5": "qwen3_5_text", "lfm2": "lfm2", "granitemoehybrid": "granitemoehybrid"}


def test_an_untested_model_type_trains_through_the_plain_paths_with_a_notice(
    compose, tmp_path, capsys, monkeypatch
):
    """GPT-Neo is not in the matrix: no shared-prompt KV cache, no decode-time W @ x^T layers, a
    one-line notice, and the self-check still guards its log-probs."""
    from grpo_cli.cli.train import train_config
    from grpo_cli.logprobs import forward
    from grpo_cli.samplers import builtin

    def forbidden(*args, **kwargs):
        raise AssertionError("a fast path ran for an untested architecture")

    monkeypatch.setattr(forward, "prefill", forbidden)  # (where _forward_logits looks it up)
    monkeypatch.setattr(builtin, "few_rows_linears", forbidden)
    config = tf.GPTNeoConfig(
        vocab_size=V,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=8,
        max_position_embeddings=256,
        **IDS,
    )
    torch.manual_seed(0)
    tf.GPTNeoForCausalLM(config).save_pretrained(tmp_path / "neo", safe_serialization=True)
    cfg = compose(
        [
            "model=tiny",
            f"model.name_or_path={tmp_path / 'neo'}",
            f"model.tokenizer={build_tiny()}",
            "data.num_examples=16",
            "data.eval_size=4",
            "sampler.num_generations=4",
            "sampler.max_new_tokens=6",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "reward=[length]",
            "reward.length.unit=chars",
            "reward.length.target=4",
        ]
    )
    row = train_config(cfg, tmp_path)
    out = capsys.readouterr().out
    assert row["step"] == 2 and "eval/reward" in row
    assert "model type 'gpt_neo' is not among the architectures" in out.replace("\n", " ")
    assert "self-check ok" in out
