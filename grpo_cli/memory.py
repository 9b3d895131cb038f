"""Will training this model fit this device? An estimate from the model's config alone.

`grpo-check-env --model M` answers it before anything is downloaded or loaded: the model is built
on the meta device (shapes, no storage) to count its parameters exactly (grpo_cli.shapes, whose
names are re-exported here), and the bytes of each way to train it (full fine-tuning, LoRA, QLoRA)
are added up the way the trainer stores them, from one record of the run's settings
(`EstimateInputs`). The weights, gradients, optimizer and reference terms are exact for that
storage; the activation and runtime terms are rough, set by the module constants below (calibrated
against a measured peak, so each is used in exactly one place). A hybrid model's other layers
(Gated DeltaNet, short convolutions, Mamba-2: shapes.MixerShape) have their own activation terms
and a fixed state per sequence in the sampler's cache instead of keys and values. Then the
recommendation (the cheapest method that fits) and the advice for a run that ran out of memory.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from grpo_cli.shapes import GATED_DELTANET, MAMBA2, SHORT_CONV, MixerShape, ModelShape, lora_parameters

# The model's shape from its config, re-exported (check_env, the tests and the scripts read them here).
from grpo_cli.shapes import model_shape as model_shape
from grpo_cli.shapes import preset_source as preset_source
from grpo_cli.shapes import resolve_model_config as resolve_model_config

GIB = 2**30

# --------------------------------------------------------------------------- storage (exact)

FP32_BYTES = 4
HALF_BYTES = 2  # bf16 / fp16
# AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per trainable parameter.
ADAMW_STATE_BYTES = 8
# Bytes of optimizer state a trained weight, by optimizer.name: AdamW's two fp32 moments; 8-bit
# AdamW's two 8-bit moments (bitsandbytes, blockwise: its per-block scales are under 1% more);
# torchao's bf16 AdamW with stochastic rounding keeps its two moments in the weights' bf16.
OPTIMIZER_STATE_BYTES = {"adamw": ADAMW_STATE_BYTES, "adamw_8bit": 2, "adamw_bf16_sr": 2 * HALF_BYTES}
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
# The other layers of hybrid models (shapes.MixerShape: Gated DeltaNet, LFM2's short convolution,
# Mamba-2) keep, per token, the norms' tensors (C_NORM x hidden: each norm's input, its output and the
# copy its projection saves) and the MLP's (C_I x intermediate), and their mixer's own (MIXER_TERMS),
# counted from the tensors autograd saves in the mixers' reference PyTorch paths (transformers 5.24
# without flash-linear-attention, causal-conv1d or mamba_ssm: a CPU's path; those kernels save less).
# The scans compute in fp32 in any precision (the reference kernels cast their inputs), over rows
# padded to whole chunks. Checked against saved-tensor hooks on small models of each kind, fp32 and
# bf16 (tests/test_shapes_hybrid.py, within 10%), and once against peak RSS on 4-layer models of real
# widths on the CPU (0.86-0.98 of it, docs/performance.md); not on full-size models nor on a GPU.
C_NORM = 6
# Multiples of a mixer's widths kept per token: (in the activation dtype, in fp32, in fp32 per padded
# token of the scan). The widths: conv (the convolution's channels), heads, inner (the mixer's output
# width), keys (heads x key_dim: Gated DeltaNet's keys repeated to its value heads, Mamba-2's B and C
# repeated to its heads), matrices (heads x chunk: chunk-by-chunk matrices per head), in_proj.
# - a short convolution: in_proj's three outputs (B, C, x), B * x, the convolution's output, C * it;
# - Gated DeltaNet: the convolution's input and output, out_proj's input, the gated norm's tensors;
#   q and k with their L2 norms, the gates; in the scan v, beta, the decays, five chunk-by-chunk
#   matrices per head (the decays, the UT system, the intra-chunk attention), the chunked keys
#   and values;
# - Mamba-2: in_proj's whole output, the convolution's output and activation, dt, out_proj's input;
#   y and the gated norm's tensors; in the scan x, B and C, three chunk-by-chunk matrices per head.
MIXER_TERMS: dict[str, tuple[dict[str, int], dict[str, int], dict[str, int]]] = {
    SHORT_CONV: (dict(inner=6), {}, {}),
    GATED_DELTANET: (
        dict(conv=2, heads=1, inner=3),
        dict(keys=2, heads=5, inner=3),
        dict(keys=8, heads=4, inner=3, matrices=5),
    ),
    MAMBA2: (
        dict(in_proj=1, conv=2, heads=2, inner=1),
        dict(inner=4),
        dict(keys=4, heads=4, inner=5, matrices=3),
    ),
}
# Recurrent states (fp32) a scan keeps per row: (per chunk, more): Gated DeltaNet's state entering
# each chunk; Mamba-2's chunk states, twice, and its last.
SCAN_STATES = {GATED_DELTANET: (1, 0), MAMBA2: (2, 1)}

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


# --------------------------------------------------------------------------- the estimate's inputs


@dataclass(frozen=True)
class EstimateInputs:
    """Everything one estimate reads: the model's shape, how it trains (method, LoRA rank,
    precision, a reference model for beta > 0), a micro-batch's rows and lengths and the prompts
    sampled at once, the device, the memory savers (gradient checkpointing, chunked logits) and a
    reward model beside the policy. `dataclasses.replace(inputs, method="lora")` varies one."""

    shape: ModelShape
    method: str  # one of METHODS: full | lora | qlora
    lora_r: int = 16
    precision: str = "fp32"  # one of PRECISIONS
    beta: float = 0.0  # > 0: a reference model (full training: a second copy of the weights)
    prompts_per_micro_batch: int = 1
    num_generations: int = 8
    prompt_length: int = 256
    completion_length: int = 16
    prompts_per_sampling_batch: int | None = None  # sampled at once (a step); None: one micro-batch
    device_type: str = "cpu"  # cpu | cuda
    gradient_checkpointing: bool = False
    logprob_chunk_size: int | None = None  # trainer.logprob_chunk_size (None: auto, 0: whole logits)
    reward_model: ModelShape | None = None  # reward=model: the scorer's shape (a sequence classifier)
    reward_batch_size: int = 8
    reward_max_length: int = 1024
    teacher: ModelShape | None = None  # teacher.name_or_path (on-policy distillation): its shape
    optimizer: str = "adamw"  # optimizer.name: adamw | adamw_8bit | adamw_bf16_sr (OPTIMIZER_STATE_BYTES)
    frozen_precision: str = "same"  # trainer.frozen_precision: bf16 keeps the reference and teacher in bf16

    @property
    def rows(self) -> int:
        """A micro-batch's completions: P prompts x G."""
        return self.prompts_per_micro_batch * self.num_generations

    @property
    def sampling_rows(self) -> int:
        """The completions sampled at once."""
        return (self.prompts_per_sampling_batch or self.prompts_per_micro_batch) * self.num_generations

    @property
    def length(self) -> int:
        """A full row: prompt + completion tokens."""
        return self.prompt_length + self.completion_length

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation at this precision (activation_bytes)."""
        return activation_bytes(self.precision)


def prompts_per_micro_batch(trainer, sampler, recurrent: bool = False) -> int:
    """The prompts (groups) of a step's largest micro-batch, for the estimate: prompts_per_step /
    gradient_accumulation_steps; with trainer.micro_batch_tokens (grpo_cli/packing.py), as many
    groups at their longest as the budget holds, at least one (a longer group runs alone): the
    scoring plan's group cost (ScoringPlan.group_cost: sampler.max_prompt_length once,
    num_generations x max_new_tokens; G prompts under gradient checkpointing, or for a model with
    recurrent layers: ModelShape.recurrent). Shorter groups pack more rows into the same tokens: the
    tokens, the logits and the attention masks (rows x completion x length) stay within this bound."""
    P = max(1, int(trainer.prompts_per_step))
    if trainer.micro_batch_tokens is None:
        return max(1, P // max(1, trainer.gradient_accumulation_steps))
    if trainer.micro_batch_tokens == "auto":  # (the smallest it can choose: one group; fit.py measures)
        return 1
    from grpo_cli.packing import scoring_plan  # (torch: only where a budget is set)

    plan = scoring_plan(trainer, fast_paths=True)  # (before any model loads: the tested paths)
    if recurrent:  # (logprobs.forward.prompt_runs_once: every row runs in full)
        plan = replace(plan, prompt_once=False)
    group = plan.group_cost(sampler.max_prompt_length, sampler.max_new_tokens, sampler.num_generations)
    return max(1, min(P, int(trainer.micro_batch_tokens) // group))


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
    teacher: int = 0  # the teacher's frozen weights (teacher.name_or_path), in the reference's dtype

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
            + self.teacher
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


def mixer_layer_bytes(mixer: MixerShape, shape: ModelShape, act_bytes: int, rows: int, length: int) -> int:
    """What one non-attention layer of `mixer`'s kind keeps for backward over `rows` full rows of
    `length` tokens: the C_NORM / C_I model for its norms and MLP, MIXER_TERMS for its mixer, and
    its scan's recurrent states."""
    m, tokens = mixer, rows * length
    widths = dict(
        conv=m.conv_channels,
        heads=m.heads,
        inner=m.inner,
        keys=m.heads * m.key_dim,
        matrices=m.heads * m.chunk,
        in_proj=m.in_proj,
    )
    act, fp32, scan = (sum(n * widths[w] for w, n in terms.items()) for terms in MIXER_TERMS[m.kind])
    chunks = -(-length // m.chunk) if m.chunk else 0
    padded = rows * chunks * m.chunk  # the scan runs each row in whole chunks
    per_chunk, more = SCAN_STATES.get(m.kind, (0, 0))
    states = rows * (per_chunk * chunks + more) * m.recurrent_state
    common = C_NORM * shape.hidden_size + C_I * shape.intermediate_size
    return act_bytes * tokens * (common + act) + FP32_BYTES * (tokens * fp32 + padded * scan + states)


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


def training_activations(inputs: EstimateInputs) -> int:
    """Activations of one micro-batch's training forward, kept for its backward (and its logits:
    _logits_bytes).

    Each prompt runs once and its KV cache is shared by its G completions, so the tokens are
    P*prompt + P*G*completion; each layer also keeps its attention mask (_attention_mask_bytes).
    With gradient checkpointing the trainer runs every row in full
    (P*G*(prompt + completion) tokens: the shared prompt's cache would be recomputed per row), each
    layer keeps only its input (hidden per token) and one layer at a time is recomputed in full.
    A model with recurrent or convolution layers (shape.recurrent) runs every row in full too (a
    state is not shared by repeating a prompt's cache); its attention layers keep C_H / C_I and
    the masks, its other layers what mixer_layer_bytes counts for their kind (no mask).
    """
    shape, act, rows = inputs.shape, inputs.act_bytes, inputs.rows
    P, prompt, completion = inputs.prompts_per_micro_batch, inputs.prompt_length, inputs.completion_length
    tokens = P * prompt + rows * completion
    # The attention masks: the prompts' pass [P, 1, prompt, prompt], the completions' [rows, 1,
    # completion, prompt + completion] (or every full row's [rows, 1, length, length]).
    mask = _attention_mask_bytes(P, prompt, prompt, act)
    mask += _attention_mask_bytes(rows, completion, inputs.length, act)
    if inputs.gradient_checkpointing or shape.recurrent:
        tokens = rows * inputs.length
        mask = _attention_mask_bytes(rows, inputs.length, inputs.length, act)
    full_layer = tokens * _layer_activation_bytes_per_token(shape, act) + mask
    mixers = [(m.layers, mixer_layer_bytes(m, shape, act, rows, inputs.length)) for m in shape.mixers]
    if inputs.gradient_checkpointing:
        largest = max([full_layer] + [b for _, b in mixers])
        layers = tokens * shape.num_layers * act * shape.hidden_size + largest
    else:
        layers = shape.attention_layers * full_layer + sum(n * b for n, b in mixers)
    return layers + _logits_bytes(rows, completion, shape.vocab_size, inputs.logprob_chunk_size)


def sampling_kv_cache(inputs: EstimateInputs) -> int:
    """The sampler's cache at its longest, for every row sampled at once (inputs.sampling_rows): the
    keys and values of every attention layer for each token, and each other layer's fixed state per
    row (recurrent_state_bytes)."""
    shape = inputs.shape
    per_token = 2 * shape.num_kv_heads * shape.head_dim * shape.attention_layers * inputs.act_bytes
    return inputs.sampling_rows * (inputs.length * per_token + recurrent_state_bytes(shape, inputs.act_bytes))


def recurrent_state_bytes(shape: ModelShape, act_bytes: int) -> int:
    """One sequence's state in the non-attention layers, whatever its length (transformers'
    LinearAttentionLayer caches): each convolution's last conv_kernel inputs per channel, in the
    activation dtype, and each scan's recurrent state (heads x key_dim x value_dim), in fp32 as the
    reference scans return it."""
    return sum(
        m.layers * (act_bytes * m.conv_channels * m.conv_kernel + FP32_BYTES * m.recurrent_state)
        for m in shape.mixers
    )


def reward_model_terms(inputs: EstimateInputs) -> tuple[int, int]:
    """(weights, scoring forward) of the reward model, (0, 0) without one: its weights in the run's
    activation dtype (rewards/model.py loads it in the trainer's precision), and its scoring forward
    (reward_batch_size texts of prompt + completion tokens, at most reward_max_length; no autograd:
    a layer's inputs and its MLP's, REWARD_FORWARD_COPIES of each)."""
    scorer = inputs.reward_model
    if scorer is None:
        return 0, 0
    act = inputs.act_bytes
    tokens = inputs.reward_batch_size * min(inputs.reward_max_length, inputs.length)
    return act * scorer.total_params, REWARD_FORWARD_COPIES * act * tokens * (
        scorer.hidden_size + scorer.intermediate_size
    )


def _weights_and_trainable(inputs: EstimateInputs) -> tuple[int, int, int]:
    """(weights, trainable parameters, reference) bytes/count as `method` stores them (estimate's
    docstring)."""
    shape, method, precision = inputs.shape, inputs.method, inputs.precision
    n = shape.total_params
    reference = frozen_weight_bytes(inputs) * n if inputs.beta > 0 else 0
    if method == "full" and precision == "bf16" and inputs.optimizer == "adamw_bf16_sr":
        return HALF_BYTES * n, n, reference  # bf16 weights stepped directly: no fp32 masters
    if method == "full" and precision == "bf16":  # bf16 weights + their fp32 master copies
        return (HALF_BYTES + FP32_BYTES) * n, n, reference
    if method == "full":
        return FP32_BYTES * n, n, reference
    trainable = lora_parameters(shape, inputs.lora_r)
    if method == "lora":
        base = activation_bytes(precision) * n
    else:
        quantized = shape.linear_weight_params
        base = int(NF4_BYTES * quantized) + HALF_BYTES * (n - quantized)
    return base + FP32_BYTES * trainable, trainable, 0


def estimate(inputs: EstimateInputs) -> MemoryEstimate:
    """Peak memory of training inputs.shape with inputs.method, counted as the trainer stores things.

    full: fp32 weights (4 B/param; bf16-autocast/fp16 only autocast the forward), fp32 gradients (4),
      AdamW's two fp32 moments (8); with beta > 0 the reference model is a second fp32 copy (4).
      precision bf16: bf16 weights plus their fp32 master copies (2 + 4), the gradients moved into
      fp32 (4; the bf16 ones are freed as they move), a bf16 reference (2).
      The levers (issue #62): optimizer adamw_8bit keeps 2 B of state a weight, adamw_bf16_sr 4 (two
      bf16 moments) and, under precision bf16, no fp32 masters and bf16 gradients (2 + 2);
      frozen_precision bf16 keeps the reference (and teacher) in bf16 (2) beside an fp32 policy.
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
    reward_model: a reward model's weights for the whole run, and its scoring forward as a fourth
      phase, after sampling and before the training forward (reward_model_terms).
    """
    if inputs.method not in METHODS:
        raise ValueError(f"method={inputs.method!r} is not one of {', '.join(METHODS)}")
    if inputs.precision not in PRECISIONS:
        raise ValueError(f"precision={inputs.precision!r} is not one of {', '.join(PRECISIONS)}")
    weights, trainable, reference = _weights_and_trainable(inputs)
    training = training_activations(inputs)
    reward_weights, scoring = reward_model_terms(inputs)
    slack = allocator_slack(training, inputs.device_type, inputs.method)
    return MemoryEstimate(
        method=inputs.method,
        weights=weights,
        gradients=(HALF_BYTES if inputs.optimizer == "adamw_bf16_sr" else FP32_BYTES) * trainable,
        optimizer=OPTIMIZER_STATE_BYTES.get(inputs.optimizer, ADAMW_STATE_BYTES) * trainable,
        reference=reference,
        activations=max(training + slack, sampling_kv_cache(inputs), scoring),
        runtime=_runtime_bytes(inputs.device_type),
        gradient_checkpointing=inputs.gradient_checkpointing,
        reward_model=reward_weights,
        teacher=teacher_bytes(inputs),
    )


def frozen_weight_bytes(inputs: EstimateInputs) -> int:
    """Bytes of one frozen model's weight (the reference's, the teacher's): bf16 under precision
    bf16 or trainer.frozen_precision=bf16, else fp32."""
    half = inputs.precision == "bf16" or inputs.frozen_precision == "bf16"
    return HALF_BYTES if half else FP32_BYTES


def teacher_bytes(inputs: EstimateInputs) -> int:
    """The teacher's frozen weights (frozen_weight_bytes). Its scoring forward runs without a
    graph, one micro-batch at a time, like the reference's."""
    if inputs.teacher is None:
        return 0
    return frozen_weight_bytes(inputs) * inputs.teacher.total_params


# --------------------------------------------------------------------------- the recommendation


@dataclass(frozen=True)
class Recommendation:
    method: str  # full | lora | qlora | none
    reason: str


def sampler_share(sampler, shape: ModelShape, device_type: str, total_bytes: int, precision: str) -> int:
    """The memory a sampler with its own engine holds beside training, which training cannot use:
    vLLM's gpu_memory_utilization of the GPU (weights, activations and KV cache, reserved when
    the engine starts), or on a CPU its KV cache (kv_cache_gib) and its copy of the weights at
    the run's precision. 0 for the built-in sampler (it is the policy)."""
    if sampler.backend != "vllm":
        return 0
    if device_type == "cuda":
        return int(float(sampler.gpu_memory_utilization) * total_bytes)
    return int(float(sampler.kv_cache_gib) * 2**30) + activation_bytes(precision) * shape.total_params


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
            "(pip install -e '.[qlora]' in grpo-cli's folder).",
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
    lever = (
        f"raise trainer.gradient_accumulation_steps (now {trainer.gradient_accumulation_steps}) so each "
        "micro-batch holds fewer prompts"
        if trainer.micro_batch_tokens is None
        else f"lower trainer.micro_batch_tokens (now {trainer.micro_batch_tokens}) so each micro-batch runs "
        "fewer tokens"
    )
    return (
        f"{where} ran out of memory ({first}). Make a step fit: {lever}, or lower "
        f"trainer.prompts_per_step (now {trainer.prompts_per_step}) "
        f"or sampler.max_new_tokens (now {sampler.max_new_tokens}); trainer.gradient_checkpointing=true "
        "trades compute for activation memory; adapter=lora (or qlora on a GPU) trains adapters instead of "
        f"every weight{bf16}. `grpo-check-env --model <model> "
        "<your overrides>` estimates the peak before a run. Checkpoints already written are kept: resume "
        "with trainer.resume=auto."
    )
