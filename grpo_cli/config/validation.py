"""Whole-config validation: every problem at once, each one paragraph naming the bad value and
the fix, before any model or dataset is loaded. Values and combinations (`validate`), and keys
set that the chosen option ignores (`unused_settings`)."""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Any

from omegaconf import OmegaConf

from grpo_cli.config.schema import (
    AdapterConfig,
    DataConfig,
    LossConfig,
    SamplerConfig,
    TrainerConfig,
    sampler_correction,
)


def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each option, from the module that implements it (imported here, not
    at the top, so that a bad command line is answered before torch is imported)."""
    from grpo_cli import adapters, distributed, loss, samplers
    from grpo_cli.data import LONG_PROMPT_RULES, SOURCES
    from grpo_cli.optim import LR_SCHEDULERS, OPTIMIZERS
    from grpo_cli.precision import PRECISIONS

    return {
        "data.source": SOURCES,
        "data.long_prompts": LONG_PROMPT_RULES,
        "sampler.backend": samplers.BACKENDS,
        "environment.on_error": ("raise", "mask"),
        "environment.protocol": ("tag", "native"),
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
    "environment.max_turns",
    "environment.max_reply_tokens",
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
    "environment.timeout_s",
    "trainer.eval_steps",
    "trainer.log_completions",
    "trainer.logprob_chunk_size",
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
        if value is not None and value < 0:
            problems.append(f"{key}={value} must be >= 0.")

    s, lo, opt, tr = cfg.sampler, cfg.loss, cfg.optimizer, cfg.trainer
    G = s.num_generations
    if G < 2:
        problems.append(
            f"sampler.num_generations={G}: GRPO compares completions within a group, so it needs "
            "at least 2 per prompt; set sampler.num_generations=8 (or any value >= 2)."
        )
    if s.max_generations is not None and (s.max_generations < G or s.max_generations % max(G, 1)):
        problems.append(
            f"sampler.max_generations={s.max_generations} must be a multiple of sampler.num_generations={G} "
            f"and at least it (a prompt gets more completions {G} at a time); e.g. "
            f"sampler.max_generations={4 * G}, or null for one round."
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
    problems.extend(_validate_environment(cfg))
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
    from grpo_cli import samplers  # (each backend validates its own keys)

    if s.backend in samplers.BACKENDS:
        problems.extend(samplers.validate(cfg, W))
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
    if isinstance(value, bool):
        return "true" if value else "false"
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

    if sampler_correction(lo, cfg.sampler) == "none" and lo.tis_cap != LossConfig().tis_cap:
        shown = "none" if lo.sampler_correction == "none" else "auto (none under sampler.backend=builtin)"
        problems.append(
            f"loss.tis_cap={lo.tis_cap} is ignored with loss.sampler_correction={shown} (it caps the truncated "
            "importance-sampling weights): choose loss.sampler_correction=tis to correct for the "
            "sampler's numerics, otherwise drop loss.tis_cap."
        )
    from grpo_cli import samplers

    if cfg.sampler.backend in samplers.BACKENDS:
        for key, value in _changed(cfg.sampler, SamplerConfig(), samplers.foreign_keys(cfg.sampler.backend)):
            owner = next(n for n in samplers.BACKENDS if key in samplers.backend(n).KEYS)
            problems.append(
                f"sampler.{key}={_shown(value)} is ignored by sampler.backend={cfg.sampler.backend} (only "
                f"sampler.backend={owner} reads it): choose sampler={owner} (grpo-train sampler={owner} "
                f"sampler.{key}={_cli(value)}), otherwise drop sampler.{key}."
            )
    if not tr.dynamic_sampling and tr.max_sampling_tries != TrainerConfig().max_sampling_tries:
        problems.append(
            f"trainer.max_sampling_tries={tr.max_sampling_tries} is ignored with trainer.dynamic_sampling="
            "false (it bounds the rollouts dynamic sampling makes to fill a step with groups that carry "
            "signal): set trainer.dynamic_sampling=true to use it, otherwise drop trainer.max_sampling_tries."
        )
    if lo.zero_std != "mask" and tr.skip_zero_std != TrainerConfig().skip_zero_std:
        problems.append(
            f"trainer.skip_zero_std={_cli(tr.skip_zero_std)} is ignored with loss.zero_std={lo.zero_std}: "
            "zero-std groups keep loss terms (the KL pull, or a weight) there, so they always go through "
            "the forward and backward; it applies to loss.zero_std=mask, otherwise drop it."
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


def _validate_environment(cfg) -> list[str]:
    """environment.*: one of fn and tools, importable; a budget that fits the vLLM engine."""
    env = cfg.environment
    if not env.fn and not env.tools:
        return []
    problems = []
    if env.fn and env.tools:
        problems.append(
            f"environment.fn={env.fn!r} and environment.tools={list(env.tools)} are both set; choose one "
            "(an environment of your own, or tools that make the tool environment)."
        )
    if env.max_episode_tokens is not None and env.max_episode_tokens < 1:
        problems.append(f"environment.max_episode_tokens={env.max_episode_tokens} must be >= 1, or null.")
    from grpo_cli.environments import environment_factory
    from grpo_cli.errors import UserError

    try:
        environment_factory(env)
    except UserError as exc:
        problems.append(str(exc))
    s = cfg.sampler
    if s.backend == "vllm" and s.max_model_len is None:
        problems.append(
            "sampler=vllm with an environment: set sampler.max_model_len to the longest episode's "
            "sequence (the prompt with the environment's instructions, plus environment.max_episode_tokens), "
            f"e.g. sampler.max_model_len={s.max_prompt_length + 512}; the default "
            "(max_prompt_length + max_new_tokens) holds one turn only."
        )
    return problems
