"""Will training this model fit this device? An estimate from the model's config alone.

`grpo-check-env --model M` answers it before anything is downloaded or loaded: the model is built
on the meta device (shapes, no storage) to count its parameters exactly, and the bytes of each
way to train it (full fine-tuning, LoRA, QLoRA) are added up the way the trainer stores them.
The weights, gradients, optimizer and reference terms are exact for that storage; the activation
and runtime terms are rough, set by the module constants below (calibrated against a measured
peak, so each is used in exactly one place).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line

GIB = 2**30

# --------------------------------------------------------------------------- storage (exact)

FP32_BYTES = 4
HALF_BYTES = 2  # bf16 / fp16
# AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per trainable parameter.
ADAMW_STATE_BYTES = 8
# bitsandbytes NF4 with double quantization: 4 bits per weight + an 8-bit absmax per block of 64
# + an fp32 second-level scale per 256 blocks = 4.127 bits, about 0.52 bytes per weight.
NF4_BYTES = 0.52

# --------------------------------------------------------------------------- activations (rough)

# Bytes kept for backward per token and layer, in units of the activation dtype's size:
# C_H * hidden_size + C_I * intermediate_size (norm inputs, q/k/v, attention output, residuals;
# the MLP's gate/up/act products), from the layer's structure. Checked with saved-tensor hooks at
# SmolLM2-135M's shape (8 x 1,024 completion tokens): a layer keeps 11,975 floats per token beside
# its attention mask, against the 11,904 counted here.
C_H = 10
C_I = 4
# Copies of the [rows, completion, vocab] fp32 logits alive at the loss: the logits (their
# tempered log-softmax input) and their gradient. Measured (scripts/bench_memory_estimate.py,
# Qwen2.5-0.5B shape at 8 x 256 and 8 x 512 completion tokens, fp32 and bf16): two copies put the
# whole-logits path's estimate within 4% of its peak; three (a separate tempered copy) were 1.1x.
LOGITS_COPIES = 2

# Memory the allocator holds beyond the live activations, as a fraction of them, by device and
# method: freed activations of earlier steps that cannot hold the next step's tensors
# (fragmentation). On the CPU (glibc malloc) with adapters (SmolLM2-135M, the default recipe's
# shape, scripts/bench_lora.py memory): peak RSS exceeds the live tensors by ~0.85x the
# activations. With full training the gradients (counted on their own) and the optimizer state
# reuse that memory: its peaks at 8 x 256-512 completion tokens (SmolLM2-135M, Qwen2.5-0.5B
# shapes) are the live tensors' within 8%. On a GPU, PyTorch's caching allocator: not measured
# here (no GPU), a guess.
ALLOCATOR_SLACK = {
    "cpu": {"full": 0.0, "lora": 0.85, "qlora": 0.85},
    "cuda": {"full": 0.25, "lora": 0.25, "qlora": 0.25},
}
# ... and at most this many bytes, by device. glibc keeps freed small blocks in its heap but hands
# blocks above its mmap threshold (at most 32 MiB) back to the system, so the slack does not grow
# with large activations: with adapters at the Qwen2.5-1.5B shape, 8 x 256 completion tokens
# (activations ~12.6 GiB), the peak exceeded the live tensors by 2.35 GiB (0.19x), where 0.85x
# would have put the estimate at 1.39x the peak.
ALLOCATOR_SLACK_MAX_BYTES = {"cpu": int(2.5 * GIB), "cuda": None}


def allocator_slack(training: int, device_type: str, method: str) -> int:
    """The allocator's slack over `training` bytes of activations (ALLOCATOR_SLACK, capped by
    ALLOCATOR_SLACK_MAX_BYTES)."""
    slack = int(training * ALLOCATOR_SLACK.get(device_type, {}).get(method, 0.0))
    cap = ALLOCATOR_SLACK_MAX_BYTES.get(device_type)
    return slack if cap is None else min(slack, cap)


# --------------------------------------------------------------------------- runtime (rough)

# Resident memory of the process before any model: Python, torch, transformers, the tokenizer.
CPU_RUNTIME_BYTES = int(0.6 * GIB)
# On a GPU: the CUDA context and the caching allocator's slack (fragmentation, workspaces).
CUDA_RUNTIME_BYTES = int(0.8 * GIB)

# A method "fits" when its estimate plus this fraction of it is within the device's memory.
HEADROOM = 0.10

METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "bf16", "bf16-autocast", "fp16")

# The real config.json values (those that set the shapes) of the shipped presets' models and a
# common larger one, so their estimates need neither the hub nor the Hugging Face cache.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
}


# --------------------------------------------------------------------------- the model's config


def conf_dir() -> Path:
    """The shipped config folder (conf/, installed as the package grpo_cli.conf)."""
    import grpo_cli.conf

    return Path(grpo_cli.conf.__file__).resolve().parent


def model_presets() -> list[str]:
    """The names of conf/model/*.yaml: what `model=NAME` (and --model NAME) accepts."""
    return sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


def preset_source(name: str) -> str | None:
    """The name_or_path of the preset `name`, or None when `name` is not a preset."""
    if "/" in name or "\\" in name or name not in model_presets():
        return None
    from omegaconf import OmegaConf

    return str(OmegaConf.load(conf_dir() / "model" / f"{name}.yaml").name_or_path)


def resolve_model_config(name_or_path: str):
    """The transformers config of a preset name, builtin:NAME, local folder or hub id, offline.

    Nothing is downloaded: a hub id is answered from KNOWN_CONFIGS or the local Hugging Face cache
    (local_files_only), so the estimate works on a machine that cannot reach the hub.
    """
    from transformers import AutoConfig

    source = preset_source(name_or_path) or name_or_path
    if source.startswith("builtin:"):
        from grpo_cli.models import BUILTINS

        name = source[len("builtin:") :]
        if name not in BUILTINS:
            raise UserError(
                f"--model {name_or_path!r}: no built-in model {name!r}; built-ins are "
                f"{', '.join('builtin:' + n for n in BUILTINS)}."
            )
        return AutoConfig.from_pretrained(BUILTINS[name]())
    folder = Path(source).expanduser()
    if folder.is_dir():
        return _folder_config(folder, name_or_path)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise UserError(
            f"--model {name_or_path!r} is not an existing folder. Point it at a folder holding the "
            "model's config.json (e.g. one written by save_pretrained), a hub id, or a preset "
            f"({', '.join(model_presets())})."
        )
    if source in KNOWN_CONFIGS:
        values = dict(KNOWN_CONFIGS[source])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as exc:  # OSError (not cached), ValueError (bad id or unknown model type), ...
        from grpo_cli.models import _hf_cache_dir

        raise UserError(
            f"the config of --model {name_or_path!r} is not available offline ({first_line(exc, 120)}): "
            f"it is not a preset ({', '.join(model_presets())}), not a local folder, not one of the "
            f"shipped configs ({', '.join(KNOWN_CONFIGS)}) and not in the Hugging Face cache "
            f"({_hf_cache_dir()}). Download the model folder where the hub is reachable (huggingface-cli "
            f"download {source} --local-dir DIR; config.json alone is enough for the estimate), copy it "
            "here and pass --model DIR; or fix the id if it is misspelt."
        ) from exc


def _folder_config(folder: Path, shown: str):
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise UserError(
            f"--model {shown!r} is a folder without config.json; point it at a model folder written by "
            "save_pretrained (or downloaded with huggingface-cli download ID --local-dir DIR)."
        )
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as exc:  # JSONDecodeError, unknown model_type, custom code, ...
        raise UserError(
            f"could not read the config.json of --model {shown!r}: {first_line(exc, 160)}. Fix or "
            "re-download the file; a model with custom code (trust_remote_code) cannot be estimated."
        ) from exc


# --------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    total_params: int  # every parameter once (tied embeddings counted once)
    linear_params: int  # weights and biases of the nn.Linear / Conv1D layers bar the output head
    linear_layers: tuple[tuple[int, int], ...]  # (in_features, out_features) of those layers
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def linear_weight_params(self) -> int:
        """The linear layers' weight matrices: what 4-bit quantization stores in NF4."""
        return sum(i * o for i, o in self.linear_layers)


def model_shape(config, *, classifier: bool = False) -> ModelShape:
    """Exact parameter counts from the model built on the meta device (no memory, no weights).
    classifier: the sequence classifier of that config (a reward model: a scoring head, no LM head).

    Counting the built modules, not a formula, keeps every architecture's biases, norms, tied heads
    and extra projections right; the linear layers are the ones PEFT's target_modules="all-linear"
    adapts: nn.Linear and transformers' Conv1D (GPT-2), bar the output head.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.pytorch_utils import Conv1D

    try:
        with torch.device("meta"):
            model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(
                config
            )
    except Exception as exc:  # an architecture without a causal-LM class, custom code, a bad config
        raise UserError(
            f"cannot build a causal LM from the {getattr(config, 'model_type', '?')!r} config: "
            f"{first_line(exc, 160)}. grpo-cli trains models that AutoModelForCausalLM supports."
        ) from exc
    head = model.get_output_embeddings()
    layers, linear_params = [], 0
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            layers.append((module.in_features, module.out_features))
        elif isinstance(module, Conv1D):
            layers.append((module.weight.shape[0], module.nf))  # weight [in, out]
        else:
            continue
        linear_params += sum(p.numel() for p in module.parameters(recurse=False))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    inter = next(
        (getattr(text, k) for k in ("intermediate_size", "ffn_dim", "n_inner") if getattr(text, k, None)),
        4 * hidden,
    )
    return ModelShape(
        model_type=str(getattr(config, "model_type", "?")),
        total_params=sum(p.numel() for p in model.parameters()),  # parameters() skips tied duplicates
        linear_params=linear_params,
        linear_layers=tuple(layers),
        num_layers=int(text.num_hidden_layers),
        hidden_size=hidden,
        intermediate_size=int(inter),
        vocab_size=int(text.vocab_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
    )


def lora_parameters(shape: ModelShape, r: int) -> int:
    """Trainable parameters of LoRA rank r on every linear layer: A [r, in] and B [out, r] each."""
    return sum(r * (i + o) for i, o in shape.linear_layers)


# --------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes of one training run, by what holds them (all ints, bytes)."""

    method: str
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    runtime: int
    gradient_checkpointing: bool = False
    reward_model: int = 0  # a reward model's weights (reward=model), beside the policy's

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.reference
            + self.activations
            + self.runtime
            + self.reward_model
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


#: A reward model's scoring forward, in [tokens, width] tensors alive at once (the residual stream,
#: a layer's input and output, its MLP's gate, up and product): an inference forward frees each
#: layer's tensors as the next runs.
REWARD_FORWARD_COPIES = 4


def activation_bytes(precision: str) -> int:
    """Bytes of one activation: fp32 without autocast, 2 under bf16/fp16 autocast."""
    return FP32_BYTES if precision == "fp32" else HALF_BYTES


def _layer_activation_bytes_per_token(shape: ModelShape, act_bytes: int) -> int:
    """What one decoder layer keeps for backward per token (the C_H / C_I model)."""
    return act_bytes * (C_H * shape.hidden_size + C_I * shape.intermediate_size)


def _attention_mask_bytes(rows: int, queries: int, keys: int, act_bytes: int) -> int:
    """One layer's attention mask, kept for its backward. A padded batch (GRPO's completions end at
    different lengths) gets a boolean [rows, 1, queries, keys] mask, which torch's SDPA converts to
    the query's dtype on every layer's call and saves: one copy per layer, quadratic in the length
    (measured with saved-tensor hooks, SmolLM2-135M shape, 8 x (60 + 1,024) tokens: an fp32
    [8, 1, 1023, 1083] copy in each layer, 34 MiB, 8% of the layer's activations)."""
    return rows * queries * keys * act_bytes


def _logits_bytes(rows: int, completion_length: int, vocab_size: int, chunk_size: int | None = None) -> int:
    """The fp32 completion logits of a micro-batch, LOGITS_COPIES times (logits, gradient);
    chunked (trainer.logprob_chunk_size, logprobs.chunk_tokens; None: auto) one chunk's only."""
    tokens = rows * completion_length
    if chunk_size != 0:
        from grpo_cli.logprobs import chunk_tokens

        tokens = min(tokens, chunk_tokens(chunk_size, vocab_size))
    return tokens * vocab_size * FP32_BYTES * LOGITS_COPIES


def _runtime_bytes(device_type: str) -> int:
    return CUDA_RUNTIME_BYTES if device_type == "cuda" else CPU_RUNTIME_BYTES


def training_activations(
    shape: ModelShape,
    *,
    precision: str,
    prompts_per_micro_batch: int,
    num_generations: int,
    prompt_length: int,
    completion_length: int,
    gradient_checkpointing: bool,
    logprob_chunk_size: int | None = None,
) -> int:
    """Activations of one micro-batch's training forward, kept for its backward (and its logits:
    _logits_bytes).

    Each prompt runs once and its KV cache is shared by its G completions, so the tokens are
    P*prompt + P*G*completion; each layer also keeps its attention mask (_attention_mask_bytes).
    With gradient checkpointing the trainer runs every row in full
    (P*G*(prompt + completion) tokens: the shared prompt's cache would be recomputed per row), each
    layer keeps only its input (hidden per token) and one layer at a time is recomputed in full.
    """
    act = activation_bytes(precision)
    rows = prompts_per_micro_batch * num_generations
    length = prompt_length + completion_length
    tokens = prompts_per_micro_batch * prompt_length + rows * completion_length
    # The attention masks: the prompts' pass [P, 1, prompt, prompt], the completions' [rows, 1,
    # completion, prompt + completion] (or every full row's [rows, 1, length, length]).
    mask = _attention_mask_bytes(prompts_per_micro_batch, prompt_length, prompt_length, act)
    mask += _attention_mask_bytes(rows, completion_length, length, act)
    if gradient_checkpointing:
        tokens = rows * length
        mask = _attention_mask_bytes(rows, length, length, act)
    full_layer = tokens * _layer_activation_bytes_per_token(shape, act) + mask
    if gradient_checkpointing:
        layers = tokens * shape.num_layers * act * shape.hidden_size + full_layer
    else:
        layers = shape.num_layers * full_layer
    return layers + _logits_bytes(rows, completion_length, shape.vocab_size, logprob_chunk_size)


def sampling_kv_cache(
    shape: ModelShape, *, precision: str, rows: int, prompt_length: int, completion_length: int
) -> int:
    """The sampler's KV cache at its longest: keys and values of every layer for every row."""
    per_token = 2 * shape.num_kv_heads * shape.head_dim * shape.num_layers * activation_bytes(precision)
    return rows * (prompt_length + completion_length) * per_token


def estimate(
    shape: ModelShape,
    *,
    method: str,
    lora_r: int = 16,
    precision: str = "fp32",
    beta: float = 0.0,
    prompts_per_micro_batch: int = 1,
    num_generations: int = 8,
    prompt_length: int = 256,
    completion_length: int = 16,
    device_type: str = "cpu",
    gradient_checkpointing: bool = False,
    prompts_per_sampling_batch: int | None = None,
    reward_model: ModelShape | None = None,
    reward_batch_size: int = 8,
    reward_max_length: int = 1024,
    logprob_chunk_size: int | None = None,
) -> MemoryEstimate:
    """Peak memory of training `shape` with `method`, counted as the trainer stores things.

    full: fp32 weights (4 B/param; bf16-autocast/fp16 only autocast the forward), fp32 gradients (4),
      AdamW's two fp32 moments (8); with beta > 0 the reference model is a second fp32 copy (4).
      precision bf16: bf16 weights plus their fp32 master copies (2 + 4), the gradients moved into
      fp32 (4; the bf16 ones are freed as they move), a bf16 reference (2).
    lora: the frozen base in fp32 (4 B/param) with precision fp32, else in bf16/fp16 (2); the
      adapters (lora_parameters) train in fp32: 4 + 4 grads + 8 AdamW = 16 B each; the reference
      is the same model with its adapters disabled (0).
    qlora (CUDA only): the linear layers' weight matrices in NF4 with double quantization (~0.52 B
      each), everything else (embeddings, norms, biases, output head) in bf16 (2); adapters as LoRA.
    activations: the larger of the training phase (one micro-batch's forward kept for backward,
      plus its logits) and the sampling phase (the KV cache of prompts_per_sampling_batch prompts x
      G completions; the trainer samples a whole step at once, default: one micro-batch). They do
      not coexist: the sampler's cache is freed before the training forward.
    runtime: CPU_RUNTIME_BYTES, or CUDA_RUNTIME_BYTES on a GPU.
    reward_model: a reward model's shape (reward=model): its weights in the run's activation dtype
      (rewards/model.py loads it in the trainer's precision) for the whole run, and its scoring
      forward (reward_batch_size texts of prompt + completion tokens, at most reward_max_length;
      no autograd: a layer's inputs and its MLP's, REWARD_FORWARD_COPIES of each) as a fourth
      phase, after sampling and before the training forward.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    n = shape.total_params
    if method == "full" and precision == "bf16":  # bf16 weights + their fp32 master copies
        weights, trainable = (HALF_BYTES + FP32_BYTES) * n, n
        reference = HALF_BYTES * n if beta > 0 else 0
    elif method == "full":
        weights, trainable = FP32_BYTES * n, n
        reference = FP32_BYTES * n if beta > 0 else 0
    else:
        trainable = lora_parameters(shape, lora_r)
        if method == "lora":
            base = activation_bytes(precision) * n
        else:
            quantized = shape.linear_weight_params
            base = int(NF4_BYTES * quantized) + HALF_BYTES * (n - quantized)
        weights, reference = base + FP32_BYTES * trainable, 0
    training = training_activations(
        shape,
        precision=precision,
        prompts_per_micro_batch=prompts_per_micro_batch,
        num_generations=num_generations,
        prompt_length=prompt_length,
        completion_length=completion_length,
        gradient_checkpointing=gradient_checkpointing,
        logprob_chunk_size=logprob_chunk_size,
    )
    sampling = sampling_kv_cache(
        shape,
        precision=precision,
        rows=(prompts_per_sampling_batch or prompts_per_micro_batch) * num_generations,
        prompt_length=prompt_length,
        completion_length=completion_length,
    )
    scoring, reward_weights = 0, 0
    if reward_model is not None:
        act = activation_bytes(precision)
        reward_weights = act * reward_model.total_params
        tokens = reward_batch_size * min(reward_max_length, prompt_length + completion_length)
        scoring = (
            REWARD_FORWARD_COPIES * act * tokens * (reward_model.hidden_size + reward_model.intermediate_size)
        )
    return MemoryEstimate(
        method=method,
        weights=weights,
        gradients=FP32_BYTES * trainable,
        optimizer=ADAMW_STATE_BYTES * trainable,
        reference=reference,
        activations=max(training + allocator_slack(training, device_type, method), sampling, scoring),
        runtime=_runtime_bytes(device_type),
        gradient_checkpointing=gradient_checkpointing,
        reward_model=reward_weights,
    )


# --------------------------------------------------------------------------- the recommendation


@dataclass(frozen=True)
class Recommendation:
    method: str  # full | lora | qlora | none
    reason: str


def fits(total: int, available_bytes: int) -> bool:
    """Whether `total` bytes plus HEADROOM of them fit: estimates are rough, allocators fragment."""
    return total * (1 + HEADROOM) <= available_bytes


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def recommend(
    estimates: Iterable[MemoryEstimate] | Mapping[str, MemoryEstimate], available_bytes: int, cuda: bool
) -> Recommendation:
    """The cheapest-to-run method that fits: full fine-tuning (best results, no adapter to merge),
    else LoRA, else QLoRA (CUDA only: bitsandbytes' 4-bit kernels), else none, with what to change."""
    by_method = {e.method: e for e in (estimates.values() if isinstance(estimates, Mapping) else estimates)}
    have = _gib(available_bytes)
    full, lora, qlora = (by_method.get(m) for m in METHODS)
    if full and fits(full.total, available_bytes):
        return Recommendation("full", f"full fine-tuning needs ~{_gib(full.total)} of {have}.")
    tried = [f"{e.method} ~{_gib(e.total)}" for e in (full, lora) if e]
    if lora and fits(lora.total, available_bytes):
        return Recommendation(
            "lora",
            f"full fine-tuning needs ~{_gib(full.total) if full else '?'} (+{HEADROOM:.0%} headroom), more "
            f"than {have}; LoRA needs ~{_gib(lora.total)}.",
        )
    if cuda and qlora and fits(qlora.total, available_bytes):
        return Recommendation(
            "qlora",
            f"neither fits in {have} ({', '.join(tried)}); QLoRA needs ~{_gib(qlora.total)} "
            "(pip install 'grpo-cli[qlora]').",
        )
    if cuda and qlora:
        tried.append(f"qlora ~{_gib(qlora.total)}")
        gpu = ""
    else:
        gpu = " QLoRA needs a CUDA GPU (bitsandbytes' 4-bit kernels), so it is no option here."
    checkpointing = all(e.gradient_checkpointing for e in by_method.values())
    advice = "lower trainer.prompts_per_step or raise trainer.gradient_accumulation_steps"
    advice += ", shorten sampler.max_new_tokens / sampler.max_prompt_length"
    if not checkpointing:
        advice += ", set trainer.gradient_checkpointing=true"
    return Recommendation(
        "none",
        f"nothing fits in {have} with {HEADROOM:.0%} headroom ({', '.join(tried)}).{gpu} To fit: {advice}; "
        "or train a smaller model.",
    )


# --------------------------------------------------------------------------- out of memory


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA out-of-memory error, or the CPU allocator's failure (a RuntimeError)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def out_of_memory_advice(exc: BaseException, trainer, sampler, device: str) -> str:
    """One paragraph for a run that ran out of memory: what happened and the settings that make
    a step fit, biggest lever first (`trainer`, `sampler`: the run's config groups)."""
    where = "the GPU" if "CUDA" in str(exc) or device.startswith("cuda") else "the machine"
    bf16 = "" if "bf16" in str(trainer.precision) else "; trainer.precision=bf16 halves the activations"
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (
        f"{where} ran out of memory ({first}). Make a step fit: raise "
        f"trainer.gradient_accumulation_steps (now {trainer.gradient_accumulation_steps}) so each "
        f"micro-batch holds fewer prompts, or lower trainer.prompts_per_step (now {trainer.prompts_per_step}) "
        f"or sampler.max_new_tokens (now {sampler.max_new_tokens}); trainer.gradient_checkpointing=true "
        "trades compute for activation memory; adapter=lora (or qlora on a GPU) trains adapters instead of "
        f"every weight{bf16}. `grpo-check-env --model <model> "
        "<your overrides>` estimates the peak before a run. Checkpoints already written are kept: resume "
        "with trainer.resume=auto."
    )
