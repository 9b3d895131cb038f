"""Hybrid models in the memory estimate (issue #61): Qwen3.5's Gated DeltaNet linear attention, LFM2's
short convolutions and granitemoehybrid's Mamba-2 layers beside attention. Their shapes (exact
parameter counts, the layer kinds read from the built modules), the shipped configs of
Qwen3.5-0.8B and Qwen3-0.6B (offline), the per-layer activation formulas against the tensors autograd
really saves, the sampler's cache (KV for attention layers only, a fixed state per row for the
others), and grpo-check-env on both models."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import transformers as tf

from grpo_cli import memory, shapes
from grpo_cli.cli import check_env

if not hasattr(tf, "Qwen3_5ForCausalLM"):
    pytest.skip(
        f"transformers {tf.__version__} has no qwen3_5 (its shapes are built from its classes)",
        allow_module_level=True,
    )


def tiny_configs():
    """The three hybrid kinds, tiny: the architecture matrix's (tests/test_architectures.py)."""
    from test_architectures import HYBRIDS

    return {name: make().config for name, make in HYBRIDS.items()}


def real_model(config):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "name, kind, mixer_layers, attention_layers, mlp_width",
    [
        ("qwen3_5", shapes.GATED_DELTANET, 3, 1, 64),
        ("lfm2", shapes.SHORT_CONV, 2, 2, 256),  # block_auto_adjust_ff_dim: 64 -> 256 as built
        ("granitemoehybrid", shapes.MAMBA2, 2, 1, 64),
    ],
)
def test_hybrid_shapes_count_the_real_parameters_and_layer_kinds(
    name, kind, mixer_layers, attention_layers, mlp_width
):
    from peft import LoraConfig, get_peft_model

    config = tiny_configs()[name]
    model = real_model(config)
    shape = memory.model_shape(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.linear_params == sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()
        for p in m.parameters(recurse=False)
    )
    assert [(m.kind, m.layers) for m in shape.mixers] == [(kind, mixer_layers)]
    assert (shape.attention_layers, shape.recurrent, shape.intermediate_size) == (
        attention_layers,
        True,
        mlp_width,
    )
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert memory.lora_parameters(shape, 4) == sum(p.numel() for p in peft.parameters() if p.requires_grad)


MIXERS = {
    # a convolution over q, k (2 heads x 8 each) and v (4 x 8); in_proj also makes z, b and a
    "qwen3_5": shapes.MixerShape(
        shapes.GATED_DELTANET, 3, conv_channels=64, conv_kernel=4, heads=4, key_dim=8, value_dim=8,
        inner=32, in_proj=64 + 32 + 2 * 4, chunk=64,
    ),
    # a convolution of conv_L_cache 3 over the hidden size; in_proj makes B, C and x
    "lfm2": shapes.MixerShape(
        shapes.SHORT_CONV, 2, conv_channels=32, conv_kernel=3, heads=0, key_dim=0, value_dim=0,
        inner=32, in_proj=3 * 32, chunk=0,
    ),
    # d_inner 64 and B, C (1 group x d_state 8 each) convolved; in_proj also makes the gate and dt
    "granitemoehybrid": shapes.MixerShape(
        shapes.MAMBA2, 2, conv_channels=80, conv_kernel=4, heads=4, key_dim=8, value_dim=16,
        inner=64, in_proj=2 * 64 + 2 * 8 + 4, chunk=256,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MIXERS))
def test_the_mixer_widths_are_the_built_modules(name):
    assert memory.model_shape(tiny_configs()[name]).mixers == (MIXERS[name],)
    assert MIXERS["qwen3_5"].recurrent_state == 4 * 8 * 8 and MIXERS["lfm2"].recurrent_state == 0


def test_attention_models_have_no_mixers():
    config = tf.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    )
    shape = memory.model_shape(config)
    assert shape.mixers == () and not shape.recurrent
    assert shape.attention_layers == 2 and shape.intermediate_size == 48


# Qwen3.5-0.8B's text model as its config.json sets it (shapes.KNOWN_CONFIGS cites the source),
# built here from transformers' own config class: the shipped entry must give the same model.
QWEN35_08B_TEXT = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
)
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)


def meta_count(model_class, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


@pytest.mark.parametrize(
    "model, model_type, total, reference",
    [
        (
            "Qwen/Qwen3.5-0.8B",
            "qwen3_5",
            752_393_024,
            lambda: meta_count(tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**QWEN35_08B_TEXT)),
        ),
        (
            "Qwen/Qwen3-0.6B",
            "qwen3",
            596_049_920,
            lambda: meta_count(tf.Qwen3ForCausalLM, tf.Qwen3Config(**QWEN3_06B)),
        ),
    ],
)
def test_the_shipped_configs_build_the_real_models_offline(monkeypatch, model, model_type, total, reference):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = memory.resolve_model_config(model)
    shape = memory.model_shape(config)
    assert (shape.model_type, shape.total_params) == (model_type, total) and reference() == total
    assert shapes.model_type_offline(model) == model_type


def test_qwen35_08b_is_the_text_model_of_a_multimodal_config():
    config = memory.resolve_model_config("Qwen/Qwen3.5-0.8B")
    assert config.model_type == "qwen3_5" and config.vision_config.depth == 12
    text = config.get_text_config()
    assert text.model_type == "qwen3_5_text" and text.tie_word_embeddings
    assert Counter(text.layer_types) == {"linear_attention": 18, "full_attention": 6}
    shape = memory.model_shape(config)
    (gdn,) = shape.mixers
    assert (gdn.kind, gdn.layers, shape.attention_layers) == (shapes.GATED_DELTANET, 18, 6)
    assert (gdn.conv_channels, gdn.heads, gdn.recurrent_state) == (
        2 * 16 * 128 + 16 * 128,
        16,
        16 * 128 * 128,
    )
    assert (shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (2, 256, 3584)


# --------------------------------------------------------------------------- activations


def saved_bytes_per_layer(model, rows: int, length: int) -> Counter:
    """Bytes of the tensors a training forward saves for backward, by decoder layer (each storage
    once, the parameters left out: they are the weights' term)."""
    layers = shapes._decoder_layers(model, model.config.get_text_config().num_hidden_layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, seen, saved = [None], set(), Counter()
    hooks = [
        h
        for i, layer in enumerate(layers)
        for h in (
            layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)),
            layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)),
        )
    ]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen | params:
            seen.add(storage.data_ptr())
            if current[0] is not None:
                saved[current[0]] += storage.nbytes()
        return t

    torch.manual_seed(0)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(3, 100, (rows, length)), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return saved


def formula_configs():
    """One layer of each kind beside an attention layer, widths apart so each term shows."""
    return {
        "qwen3_5": tf.Qwen3_5TextConfig(
            vocab_size=103,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            layer_types=["linear_attention", "full_attention"],
        ),
        "lfm2": tf.Lfm2Config(
            vocab_size=103,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"],
        ),
        "granitemoehybrid": tf.GraniteMoeHybridConfig(
            vocab_size=103,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_expand=2,
            mamba_d_conv=4,
            shared_intermediate_size=96,
            num_local_experts=0,
            mamba_chunk_size=64,
        ),
    }


@pytest.mark.parametrize("name", list(formula_configs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, length", [(2, 50), (2, 130)])  # one chunk, padded; three chunks
def test_mixer_layer_bytes_are_what_the_training_forward_saves(monkeypatch, name, dtype, rows, length):
    """memory.mixer_layer_bytes against the tensors autograd keeps in the layer (the reference PyTorch
    paths of transformers 5.24: no flash-linear-attention, causal-conv1d or mamba_ssm here), within
    10%: in fp32, and with bf16 weights, whose scans still compute in fp32."""
    config = formula_configs()[name]
    model = real_model(config).to(dtype).train()
    shape = memory.model_shape(config)
    (mixer,) = shape.mixers
    act = 4 if dtype == torch.float32 else 2
    measured = saved_bytes_per_layer(model, rows, length)[0]  # layer 0 is the mixer
    assert memory.mixer_layer_bytes(mixer, shape, act, rows, length) == pytest.approx(measured, rel=0.10)


def hybrid_shape(**mixer_widths) -> memory.ModelShape:
    """4 layers with round widths: 1 attention layer, 3 Gated DeltaNet layers."""
    mixer = shapes.MixerShape(
        **{
            **dict(
                kind=shapes.GATED_DELTANET,
                layers=3,
                conv_channels=40,
                conv_kernel=4,
                heads=2,
                key_dim=5,
                value_dim=10,
                inner=20,
                in_proj=64,
                chunk=8,
            ),
            **mixer_widths,
        }
    )
    return memory.ModelShape(
        model_type="test",
        total_params=1000,
        linear_params=800,
        linear_layers=((10, 20),),
        num_layers=4,
        hidden_size=10,
        intermediate_size=20,
        vocab_size=50,
        num_heads=2,
        num_kv_heads=1,
        head_dim=5,
        mixers=(mixer,),
        recurrent=True,
    )


RUN = dict(
    prompts_per_micro_batch=2, num_generations=4, prompt_length=8, completion_length=3, device_type="cpu"
)


def test_hybrid_training_runs_full_rows_and_sums_each_kind():
    shape = hybrid_shape()
    inputs = memory.EstimateInputs(shape, "full", **RUN)
    rows, length = 8, 11
    attention = rows * length * 4 * (memory.C_H * 10 + memory.C_I * 20) + 4 * rows * length * length
    gdn = memory.mixer_layer_bytes(shape.mixers[0], shape, 4, rows, length)
    logits = rows * 3 * 50 * 4 * memory.LOGITS_COPIES
    assert memory.training_activations(inputs) == attention + 3 * gdn + logits
    # checkpointing: every layer's input, and the largest layer (a Gated DeltaNet one here) recomputed
    ckpt = memory.EstimateInputs(shape, "full", gradient_checkpointing=True, **RUN)
    assert gdn > attention
    assert memory.training_activations(ckpt) == rows * length * 4 * 4 * 10 + gdn + logits
    # the Gated DeltaNet term by hand: 2 chunks of 8 per row of 11 tokens
    tokens, padded = rows * length, rows * 16
    by_hand = 4 * tokens * (6 * 10 + 4 * 20) + 4 * tokens * (2 * 40 + 1 * 2 + 3 * 20)
    by_hand += 4 * tokens * (2 * 10 + 5 * 2 + 3 * 20) + 4 * padded * (8 * 10 + 4 * 2 + 3 * 20 + 5 * 16)
    by_hand += 4 * rows * 2 * (2 * 5 * 10)  # the state entering each chunk
    assert gdn == by_hand


def test_the_sampling_cache_is_kv_for_attention_layers_and_a_state_per_row_for_the_others():
    shape = hybrid_shape()
    inputs = memory.EstimateInputs(shape, "full", prompts_per_sampling_batch=64, **RUN)
    kv = (
        256 * 11 * 2 * 1 * 5 * 1 * 4
    )  # rows x tokens x (k, v) x kv heads x head_dim x 1 attention layer x 4 B
    states = 256 * 3 * (4 * 40 * 4 + 4 * 2 * 5 * 10)  # rows x layers x (conv inputs + fp32 recurrent state)
    assert memory.sampling_kv_cache(inputs) == kv + states
    assert memory.recurrent_state_bytes(shape, 4) == 3 * (4 * 40 * 4 + 4 * 2 * 5 * 10)
    assert memory.estimate(inputs).activations == max(
        memory.training_activations(inputs), kv + states
    )  # (the full method's CPU slack is 0)


def test_a_token_budget_runs_a_recurrent_models_rows_in_full():
    """trainer.micro_batch_tokens: a group of a model with recurrent layers costs G full rows (no
    shared prompt): 4 x (64 + 32) = 384 tokens, where an attention model's costs 64 + 4 x 32 = 192."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        prompts_per_step=8,
        gradient_accumulation_steps=1,
        micro_batch_tokens=1000,
        gradient_checkpointing=False,
    )
    sampler = SimpleNamespace(max_prompt_length=64, max_new_tokens=32, num_generations=4)
    assert memory.prompts_per_micro_batch(trainer, sampler) == 5
    assert memory.prompts_per_micro_batch(trainer, sampler, recurrent=True) == 2


# --------------------------------------------------------------------------- grpo-check-env


@pytest.mark.parametrize(
    "model, params, model_type",
    [("Qwen/Qwen3.5-0.8B", 752_393_024, "qwen3_5"), ("Qwen/Qwen3-0.6B", 596_049_920, "qwen3")],
)
def test_check_env_estimates_the_new_models_offline(capsys, monkeypatch, model, params, model_type):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (
        check_env.main(["--model", model, "--memory-gib", "24", "trainer.gradient_checkpointing=true"]) == 0
    )
    out = capsys.readouterr().out
    assert f"memory estimate: {model} ({model_type})" in out and f"parameters       {params:,} total" in out
    assert "recommended: full" in out
    hybrid = "layers           6 attention + 18 gated deltanet (every row runs in full" in out
    assert hybrid is (model_type == "qwen3_5")


def test_check_env_counts_qwen35s_layers_apart(capsys, monkeypatch):
    """The JSON estimate of Qwen3.5-0.8B: its 18 Gated DeltaNet layers keep far more per token than
    its 6 attention layers in the reference scan, so its activations exceed Qwen3-0.6B's (28
    attention layers) at the same settings, and its rows run in full."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    totals, layers = {}, {}
    for model in ("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3-0.6B"):
        assert check_env.main(["--model", model, "--memory-gib", "64", "--json"]) == 0
        est = json.loads(capsys.readouterr().out)["memory_estimate"]
        totals[model], layers[model] = est["methods"]["full"]["activations"], est["layers"]
    assert totals["Qwen/Qwen3.5-0.8B"] > 5 * totals["Qwen/Qwen3-0.6B"]
    assert layers == {
        "Qwen/Qwen3.5-0.8B": {"attention": 6, "gated_deltanet": 18},
        "Qwen/Qwen3-0.6B": {"attention": 28},
    }


@pytest.mark.parametrize("preset, params", [("qwen3.5-0.8b", 752_393_024), ("qwen3-0.6b", 596_049_920)])
def test_check_env_accepts_the_presets(capsys, monkeypatch, preset, params):
    if preset not in shapes.model_presets():
        pytest.skip(f"no conf/model/{preset}.yaml in this checkout")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_env.main(["--model", preset, "--memory-gib", "64", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)["memory_estimate"]
    assert est["params"]["total"] == params and est["name_or_path"].startswith("Qwen/Qwen3")
