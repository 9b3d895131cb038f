"""grpo_cli.memory and `grpo-check-env --model`: exact parameter counts from the config alone, the
byte accounting of full fine-tuning / LoRA / QLoRA, the recommendation, and the command."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from grpo_cli import memory
from grpo_cli.cli import check_env
from grpo_cli.errors import UserError

GIB = 2**30


def small_configs():
    return {
        "llama-tied": LlamaConfig(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        "qwen2-untied": Qwen2Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        ),
        "gpt2-conv1d": GPT2Config(vocab_size=89, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    }


def real_model(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(small_configs()))
def test_parameter_count_is_exact(name):
    config = small_configs()[name]
    model = real_model(config)
    shape = memory.model_shape(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())  # tied weights once
    assert (shape.hidden_size, shape.vocab_size) not in shape.linear_layers  # the output head is not adapted
    assert shape.linear_params == sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
        if m is not model.get_output_embeddings()
        for p in m.parameters(recurse=False)
    )


@pytest.mark.parametrize("name", list(small_configs()))
def test_lora_parameters_equal_peft_trainable_parameters(name):
    from peft import LoraConfig, get_peft_model

    config = small_configs()[name]
    peft_model = get_peft_model(
        real_model(config), LoraConfig(r=4, target_modules="all-linear", fan_in_fan_out=name == "gpt2-conv1d")
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert memory.lora_parameters(memory.model_shape(config), 4) == trainable


@pytest.mark.parametrize(
    "model, total, layers, kv_heads, head_dim",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768, 24, 2, 64),
        ("Qwen/Qwen2.5-1.5B-Instruct", 1_543_714_304, 28, 2, 128),
        ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512, 28, 4, 128),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 134_515_008, 30, 3, 64),
        ("Qwen/Qwen3-0.6B", 596_049_920, 28, 8, 128),
        pytest.param(
            *("Qwen/Qwen3.5-0.8B", 752_393_024, 24, 2, 256),  # its text model (tests/test_shapes_hybrid.py)
            marks=pytest.mark.skipif(
                "qwen3_5" not in CONFIG_MAPPING_NAMES,
                reason="this transformers has no Qwen3.5 (added in 5.x)",
            ),
        ),
        ("qwen0.5b", 494_032_768, 24, 2, 64),  # a conf/model preset name
        ("smollm2-135m", 134_515_008, 30, 3, 64),
    ],
)
def test_known_configs_give_the_real_parameter_counts(model, total, layers, kv_heads, head_dim):
    shape = memory.model_shape(memory.resolve_model_config(model))
    assert (shape.total_params, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        total,
        layers,
        kv_heads,
        head_dim,
    )


def test_config_from_a_local_folder_and_the_builtin(tmp_path):
    small_configs()["llama-tied"].save_pretrained(tmp_path)
    assert memory.resolve_model_config(str(tmp_path)).hidden_size == 32
    assert memory.resolve_model_config("tiny").model_type == "llama"  # builtin:tiny via the preset
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="without config.json"):
        memory.resolve_model_config(str(empty))
    with pytest.raises(UserError, match="not an existing folder"):
        memory.resolve_model_config(str(tmp_path / "missing"))


def test_unknown_hub_id_is_a_user_error_naming_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="nobody/not-a-model.*not available offline"):
        memory.resolve_model_config("nobody/not-a-model")


# A shape with round numbers, so each term can be checked by hand.
SHAPE = memory.ModelShape(
    model_type="test",
    total_params=1000,
    linear_params=800,
    linear_layers=((10, 20), (20, 10), (10, 30)),  # 200 + 200 + 300 = 700 weights
    num_layers=2,
    hidden_size=10,
    intermediate_size=20,
    vocab_size=50,
    num_heads=2,
    num_kv_heads=1,
    head_dim=5,
)
RUN = dict(
    prompts_per_micro_batch=2, num_generations=4, prompt_length=8, completion_length=3, device_type="cpu"
)


def estimate(**settings) -> memory.MemoryEstimate:
    """memory.estimate of SHAPE with these settings (memory.EstimateInputs' fields)."""
    return memory.estimate(memory.EstimateInputs(SHAPE, **settings))


def test_weights_gradients_optimizer_and_reference_terms():
    adapters = memory.lora_parameters(SHAPE, 2)
    assert adapters == 2 * (30 + 30 + 40)
    full0, full = (estimate(method="full", lora_r=2, beta=b, **RUN) for b in (0.0, 0.04))
    assert (full.weights, full.gradients, full.optimizer, full.reference) == (4000, 4000, 8000, 4000)
    assert full0.reference == 0 and full.total - full0.total == 4000
    for method, base in (("lora", 4 * 1000), ("qlora", int(0.52 * 700) + 2 * 300)):
        e0, e = (estimate(method=method, lora_r=2, beta=b, **RUN) for b in (0.0, 0.04))
        assert e0 == e  # beta needs no second copy: the reference is the adapters-disabled model
        assert (e.weights, e.gradients, e.optimizer, e.reference) == (
            base + 4 * adapters,
            4 * adapters,
            8 * 200,
            0,
        )
        assert e.total - e.activations < full0.total - full0.activations  # (activations: their own test)
    bf16 = estimate(method="lora", lora_r=2, precision="bf16", **RUN)
    assert bf16.weights == 2 * 1000 + 4 * adapters  # the frozen base in bf16, the adapters in fp32
    # precision=bf16, full: bf16 weights and their fp32 masters, a bf16 reference
    bf16 = estimate(method="full", precision="bf16", beta=0.04, **RUN)
    assert (bf16.weights, bf16.gradients, bf16.optimizer, bf16.reference) == (6000, 4000, 8000, 2000)
    autocast = estimate(method="full", precision="bf16-autocast", beta=0.04, **RUN)
    assert (autocast.weights, autocast.reference) == (4000, 4000)  # fp32 weights, cast at each use


def test_activation_terms():
    act_fp32 = 4 * (memory.C_H * 10 + memory.C_I * 20)  # per token and layer
    tokens = 2 * 8 + 2 * 4 * 3  # each prompt once, then its 4 completions
    # per layer: the prompts' [2, 1, 8, 8] and the completions' [8, 1, 3, 8 + 3] attention masks
    mask = 4 * (2 * 8 * 8 + 8 * 3 * 11)
    logits = 2 * 4 * 3 * 50 * 4 * memory.LOGITS_COPIES
    slack = 1 + memory.ALLOCATOR_SLACK["cpu"]["full"]
    layers = 2 * (tokens * act_fp32 + mask)
    e = estimate(method="full", **RUN)
    assert e.activations == int((layers + logits) * slack)
    assert e.runtime == memory.CPU_RUNTIME_BYTES
    ckpt = estimate(method="full", gradient_checkpointing=True, **RUN)
    rows_tokens = 2 * 4 * (8 + 3)  # checkpointing runs every row in full (no shared prompt)
    one_layer = rows_tokens * act_fp32 + 4 * 8 * 11 * 11  # recomputed in full, its [8, 1, 11, 11] mask
    assert ckpt.activations == int((rows_tokens * 2 * 4 * 10 + one_layer + logits) * slack)
    bf16 = estimate(method="full", precision="bf16", **RUN)
    assert bf16.activations == int((layers // 2 + logits) * slack)  # logits stay fp32
    cuda = estimate(method="full", **{**RUN, "device_type": "cuda"})
    assert cuda.runtime == memory.CUDA_RUNTIME_BYTES
    assert cuda.activations == int((layers + logits) * (1 + memory.ALLOCATOR_SLACK["cuda"]["full"]))
    # adapters: nothing as large as the gradients reuses the freed activations (the CPU's slack)
    lora = estimate(method="lora", lora_r=2, **RUN)
    live = layers + logits
    assert lora.activations == live + int(live * memory.ALLOCATOR_SLACK["cpu"]["lora"])
    assert lora.activations > e.activations


@pytest.mark.parametrize(
    "training_gib, device, method, slack_gib",
    [
        (1.0, "cpu", "lora", 0.85),  # glibc's heap keeps the freed small blocks: 0.85x
        (12.5, "cpu", "lora", 2.5),  # ... but hands large ones back: at most 2.5 GiB
        (12.5, "cpu", "full", 0.0),  # the gradients and AdamW's state reuse the freed activations
        (12.5, "cuda", "lora", 12.5 * 0.25),  # the caching allocator: no cap (a guess)
    ],
)
def test_allocator_slack(training_gib, device, method, slack_gib):
    slack = memory.allocator_slack(int(training_gib * GIB), device, method)
    assert slack == pytest.approx(slack_gib * GIB, rel=1e-9)


def test_the_attention_mask_term_is_what_a_real_training_forward_keeps():
    """The estimate's quadratic term against the tensors autograd really saves: a padded batch's
    boolean mask is converted to the activations' dtype by SDPA in every layer and kept there."""
    from grpo_cli.logprobs import ScoringOptions, score_tokens

    config = small_configs()["llama-tied"]
    config.num_hidden_layers = 3
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    P, G, C = 12, 4, 40
    torch.manual_seed(0)
    prompt = torch.randint(3, 100, (1, P)).repeat(G, 1)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[:, :3] = 0  # left padding
    completion = torch.randint(3, 100, (G, C))
    completion_mask = torch.ones_like(completion)
    completion_mask[0, 30:] = 0  # a completion that ended early
    masks = {}

    def pack(t):  # the saved [rows, 1, queries, keys] float masks, one entry per storage
        if t.dim() == 4 and t.shape[1] == 1 and tuple(t.shape[2:]) in ((P, P), (C - 1, P + C - 1)):
            masks[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        score_tokens(model, prompt, prompt_mask, completion, completion_mask, ScoringOptions(1.0), G)
    # the completions' pass scores tokens 1..C-1 (token 0 from the prompt's pass) over P + C - 1 keys
    completions = memory._attention_mask_bytes(G, C - 1, P + C - 1, 4)
    prompts = memory._attention_mask_bytes(1, P, P, 4)
    assert sum(masks.values()) == config.num_hidden_layers * (completions + prompts)


def test_activations_are_the_larger_of_training_and_sampling_not_the_sum():
    kv = 64 * 4 * (8 + 3) * 2 * 1 * 5 * 2 * 4  # rows * tokens * (k, v) * kv heads * head_dim * layers * 4 B
    e = estimate(method="full", prompts_per_sampling_batch=64, **RUN)
    assert (
        e.activations
        == kv
        == memory.sampling_kv_cache(
            memory.EstimateInputs(SHAPE, "full", prompts_per_sampling_batch=64, **RUN)
        )
    )  # 64 prompts x 4 = 256 rows
    assert estimate(method="full", **RUN).activations > memory.sampling_kv_cache(
        memory.EstimateInputs(SHAPE, "full", **RUN)  # one micro-batch: 8 rows
    )


def estimates(full, lora, qlora, checkpointing=False):
    return [
        memory.MemoryEstimate(m, int(t * GIB), 0, 0, 0, 0, 0, checkpointing)
        for m, t in (("full", full), ("lora", lora), ("qlora", qlora))
    ]


@pytest.mark.parametrize(
    "totals, available_gib, cuda, expected",
    [
        ((10, 6, 3), 12, False, "full"),
        ((10, 6, 3), 10.5, False, "lora"),  # 10 GiB + 10% headroom does not fit in 10.5
        ((10, 6, 3), 10.5, True, "lora"),
        ((10, 6, 3), 5, True, "qlora"),
        ((10, 6, 3), 5, False, "none"),  # QLoRA needs a CUDA GPU
        ((10, 6, 3), 3.2, True, "none"),
    ],
)
def test_recommend(totals, available_gib, cuda, expected):
    rec = memory.recommend(estimates(*totals), int(available_gib * GIB), cuda)
    assert rec.method == expected
    if expected == "none":
        assert "trainer.gradient_checkpointing=true" in rec.reason and "smaller model" in rec.reason
        assert ("CUDA GPU" in rec.reason) is (not cuda)


def test_recommend_leaves_out_checkpointing_advice_when_it_is_on():
    rec = memory.recommend(estimates(10, 6, 3, checkpointing=True), 1 * GIB, True)
    assert rec.method == "none" and "gradient_checkpointing" not in rec.reason


def test_check_env_without_model_is_unchanged(capsys):
    assert check_env.main([]) == 0
    out = capsys.readouterr().out
    assert "grpo-cli environment report" in out and "memory estimate" not in out


def test_check_env_prints_the_estimate_table(capsys):
    assert check_env.main(["--model", "tiny", "--memory-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "grpo-cli environment report" in out  # the existing report comes first
    header = next(line for line in out.splitlines() if line.strip().startswith("method"))
    assert (
        header.split() == "method weights grads optimizer reference activations runtime total fits?".split()
    )
    assert "64.00 GiB (--memory-gib)" in out and "recommended: full" in out
    assert "LoRA r=16" in out


def test_check_env_json_holds_the_estimate_and_applies_overrides(capsys):
    args = ["--model", "tiny", "--memory-gib", "64", "--json", "--lora-r", "4"]
    overrides = [
        "loss.beta=0.04",
        "trainer.prompts_per_step=8",
        "trainer.gradient_accumulation_steps=2",
        "trainer.precision=fp32",
    ]
    assert check_env.main(args + overrides) == 0
    est = json.loads(capsys.readouterr().out)["memory_estimate"]
    assert est["name_or_path"] == "builtin:tiny" and est["recommended"]["method"] == "full"
    assert est["settings"]["prompts_per_micro_batch"] == 4 and est["settings"]["beta"] == 0.04
    assert est["methods"]["full"]["reference"] == 4 * est["params"]["total"]
    shape = memory.model_shape(memory.resolve_model_config("tiny"))
    assert est["params"]["lora_adapters"] == memory.lora_parameters(shape, 4)
    assert est["available_bytes"] == 64 * GIB


@pytest.mark.parametrize(
    "budget, checkpointing, expected",
    [(None, False, 4), (10_000, False, 8), (1_000, False, 5), (10, False, 1), (1_000, True, 2)],
)
def test_check_env_plans_for_the_largest_micro_batch_a_token_budget_allows(
    capsys, budget, checkpointing, expected
):
    """trainer.micro_batch_tokens: the estimate's micro-batch is as many groups at their longest
    (a prompt of 64 once, 4 x 32 completion tokens: 192; 4 x 96 = 384 under gradient checkpointing)
    as the budget holds, at least one, at most the step's 8."""
    overrides = [
        "trainer.prompts_per_step=8",
        "sampler.num_generations=4",
        "sampler.max_prompt_length=64",
        "sampler.max_new_tokens=32",
        f"trainer.gradient_checkpointing={str(checkpointing).lower()}",
    ]
    overrides += (
        ["trainer.gradient_accumulation_steps=2"]
        if budget is None
        else [f"trainer.micro_batch_tokens={budget}"]
    )
    assert check_env.main(["--model", "tiny", "--memory-gib", "64", "--json"] + overrides) == 0
    est = json.loads(capsys.readouterr().out)["memory_estimate"]
    assert est["settings"]["prompts_per_micro_batch"] == expected


def test_check_env_unknown_model_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        check_env.main(["--model", "nobody/not-a-model"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-check-env: ") and "nobody/not-a-model" in err and "--model DIR" in err


def test_check_env_plans_for_a_gpu_from_a_cpu_machine(capsys, monkeypatch):
    """trainer.device=cuda on a machine without one: the estimate for a bf16 GPU of --memory-gib,
    which recommends LoRA for Qwen2.5-1.5B on 24 GiB and QLoRA for 7B."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for model, expected in (("qwen1.5b", "lora"), ("Qwen/Qwen2.5-7B-Instruct", "qlora")):
        args = ["--model", model, "--memory-gib", "24", "--json", "trainer.device=cuda", "loss.beta=0.04"]
        assert check_env.main(args) == 0
        est = json.loads(capsys.readouterr().out)["memory_estimate"]
        assert est["settings"]["device_type"] == "cuda" and est["settings"]["precision"] == "bf16"
        assert est["recommended"]["method"] == expected
        assert est["methods"]["lora"]["reference"] == 0 < est["methods"]["full"]["reference"]
    assert check_env.main(["--model", "qwen1.5b", "--json", "trainer.device=cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_estimate"]["recommended"]["method"] == "unknown"


def test_the_estimate_counts_the_teacher(capsys):
    """teacher.name_or_path: the teacher's frozen weights (fp32 here: 4 bytes a parameter of its
    real count) in the total, and a line in grpo-check-env's table."""
    from grpo_cli.cli.check_env import format_estimate, memory_estimate
    from grpo_cli.models import load_model, resolve_source

    info = {"vram_gib": None, "ram_gib": 24.0, "cuda_available": False, "bf16_supported": False}
    without = memory_estimate("tiny", [], info)["methods"]["full"]
    est = memory_estimate("tiny", ["teacher.name_or_path=builtin:tiny32", "loss.teacher_kl=1"], info)
    full = est["methods"]["full"]
    params = load_model(resolve_source("builtin:tiny32"), device=torch.device("cpu")).num_parameters()
    assert without["teacher"] == 0 and full["teacher"] == 4 * params
    assert full["total"] == without["total"] + full["teacher"]
    assert "teacher" in format_estimate(est)


@pytest.mark.parametrize(
    "overrides, share_gib",
    [
        ([], 0.0),  # the built-in sampler is the policy: nothing beside it
        (["sampler=vllm", "trainer.device=cuda"], 24 * 0.3),  # gpu_memory_utilization of the GPU
        (["sampler=vllm", "trainer.device=cuda", "sampler.gpu_memory_utilization=0.5"], 12.0),
    ],
)
def test_the_estimate_leaves_vllms_share_of_the_device_to_it(overrides, share_gib):
    from grpo_cli.cli.check_env import memory_estimate

    info = {"vram_gib": None, "ram_gib": 24.0, "cuda_available": False, "bf16_supported": False}
    est = memory_estimate("qwen0.5b", overrides, info, memory_gib=24)
    assert est["sampler_share_bytes"] == pytest.approx(share_gib * 2**30, abs=1)
    assert est["available_bytes"] == pytest.approx((24 - share_gib) * 2**30, abs=1)


def test_the_estimate_counts_vllms_cpu_engine():
    """On a CPU vLLM holds its KV cache (sampler.kv_cache_gib) and its own copy of the weights."""
    from grpo_cli import memory
    from grpo_cli.cli.check_env import memory_estimate

    info = {"vram_gib": None, "ram_gib": 24.0, "cuda_available": False, "bf16_supported": False}
    est = memory_estimate("qwen0.5b", ["sampler=vllm", "sampler.kv_cache_gib=2"], info, memory_gib=24)
    weights = 4 * memory.model_shape(memory.resolve_model_config("qwen0.5b")).total_params  # fp32
    assert est["sampler_share_bytes"] == 2 * 2**30 + weights


@pytest.mark.parametrize(
    "levers, weights, grads, optimizer, reference",
    [
        ({}, 4, 4, 8, 4),  # fp32 AdamW, an fp32 reference
        ({"optimizer": "adamw_8bit"}, 4, 4, 2, 4),
        ({"frozen_precision": "bf16"}, 4, 4, 8, 2),
        ({"precision": "bf16"}, 6, 4, 8, 2),  # bf16 weights + fp32 masters
        ({"precision": "bf16", "optimizer": "adamw_bf16_sr"}, 2, 2, 4, 2),  # no masters, bf16 moments
    ],
)
def test_the_estimate_counts_each_memory_lever(levers, weights, grads, optimizer, reference):
    """Bytes a parameter of full training under each lever (memory.estimate's docstring)."""
    shape = memory.model_shape(memory.resolve_model_config("tiny"))
    n = shape.total_params
    e = memory.estimate(memory.EstimateInputs(shape, "full", beta=0.04, **levers))
    assert (e.weights, e.gradients, e.optimizer, e.reference) == (
        weights * n,
        grads * n,
        optimizer * n,
        reference * n,
    )


def test_check_env_estimates_with_the_configured_levers(capsys):
    args = ["--model", "tiny", "--memory-gib", "64", "--json"]
    levers = [
        "optimizer=adamw_8bit",
        "trainer.frozen_precision=bf16",
        "trainer.precision=fp32",
        "loss.beta=0.04",
    ]
    assert check_env.main(args + levers) == 0
    est = json.loads(capsys.readouterr().out)["memory_estimate"]
    n = est["params"]["total"]
    assert est["settings"]["optimizer"] == "adamw_8bit" and est["settings"]["frozen_precision"] == "bf16"
    assert est["methods"]["full"]["optimizer"] == 2 * n and est["methods"]["full"]["reference"] == 2 * n
