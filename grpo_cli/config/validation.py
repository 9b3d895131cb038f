"""Whole-config validation: every problem at once, each one paragraph naming the bad value and
the fix, before any model or dataset is loaded. Values and combinations (`validate`), and keys
set that the chosen option ignores (`unused_settings`).

`validate` collects the rules of each group from the module that reads it: samplers.check_sampling
(and the chosen backend's validate), optim.check_optimizer, distributed.check_processes,
environments.check_environment, trackers.check_report_to (W&B's credentials too), data.check_data,
chat_template.check_template_kwargs (model.chat_template_kwargs), adapters.check_adapter,
rewards.check_rewards. What stays here: every group's choices, counts and amounts; the loss group's
bounds (grpo_cli.loss imports torch); the trainer's batch, device and resume; and the unused
settings, which compare each group with its schema defaults."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from omegaconf import OmegaConf

from grpo_cli.config.loss_checks import loss_problems
from grpo_cli.config.schema import (
    AdapterConfig,
    DataConfig,
    EnvironmentConfig,
    LossConfig,
    SamplerConfig,
    SftConfig,
    TrainerConfig,
)


def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each option, from the module that implements it (imported here, not
    at the top, so that a bad command line is answered before torch is imported). The plug-in
    kinds' names are not here: each kind's check lists the modules found (grpo_cli/plugins.py),
    e.g. environment.style's in environments.check_environment, loss.loss_type's in loss_checks."""
    from grpo_cli import adapters, distributed, environments, loss
    from grpo_cli.data import LONG_PROMPT_RULES
    from grpo_cli.optim import LR_SCHEDULERS, OPTIMIZERS
    from grpo_cli.precision import FROZEN_PRECISIONS, PRECISIONS

    return {
        "data.long_prompts": LONG_PROMPT_RULES,
        "environment.on_error": ("raise", "mask"),
        "environment.protocol": environments.PROTOCOLS,
        "environment.reward_turns": ("sum", "last"),
        "loss.kl_estimator": loss.KL_ESTIMATORS,
        "loss.importance_sampling_level": loss.IS_LEVELS,
        "loss.scale_rewards": loss.SCALE_REWARDS,
        "loss.multi_objective_aggregation": loss.AGGREGATIONS,
        "loss.std": loss.STD_KINDS,
        "loss.estimator": loss.ESTIMATORS,
        "loss.zero_std": loss.ZERO_STD_MODES,
        "loss.sampler_correction": loss.SAMPLER_CORRECTIONS,
        "optimizer.name": OPTIMIZERS,
        "optimizer.lr_scheduler": LR_SCHEDULERS,
        "trainer.precision": PRECISIONS,
        "trainer.frozen_precision": FROZEN_PRECISIONS,
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
    "trainer.distributed_timeout_s",
    "data.num_examples",
    "data.max_operand",
    "adapter.r",
    "sft.batch_size",
)
NON_NEGATIVE = (
    "sampler.top_k",
    "environment.timeout_s",
    "trainer.eval_steps",
    "trainer.log_completions",
    "trainer.logprob_chunk_size",
    "data.eval_size",
    "data.val_size",
    "trainer.eval_samples",
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
    grpo-train prints them as notes instead).

    Each group's rules live beside the code that reads the group, and are collected here in a
    fixed order (the owners are imported here, not at the top: config/ imports nothing of theirs
    when it is imported)."""
    from grpo_cli import adapters, data, distributed, environments, optim, samplers, trackers
    from grpo_cli.band import check_band
    from grpo_cli.chat_template import check_template_kwargs
    from grpo_cli.early import check_early
    from grpo_cli.sft import check_sft

    tr = cfg.trainer
    problems = _value_problems(cfg)
    problems += samplers.check_sampling(cfg.sampler)
    problems += loss_problems(cfg.loss)
    problems += optim.check_optimizer(cfg.optimizer, cfg)
    problems += _frozen_precision_problems(tr)
    problems += check_early(cfg)
    problems += distributed.check_processes(tr)
    problems += environments.check_environment(cfg.environment)
    W = distributed.planned_world_size(tr)
    problems += _micro_batch_problems(tr, cfg.sampler.num_generations, W)
    if tr.device not in ("auto", "cpu", "cuda") and not str(tr.device).startswith("cuda:"):
        problems.append(f"trainer.device={tr.device!r} must be auto, cpu, cuda or cuda:N.")
    if tr.resume not in (None, "auto") and not str(tr.resume).strip():
        problems.append("trainer.resume is empty; use auto, a checkpoint folder, or null.")
    if tr.replay is not None and not str(tr.replay).strip():
        problems.append(
            "trainer.replay is empty; name the folder of a run saved with trainer.save_rollouts=true, or null."
        )
    problems += trackers.check_report_to(list(tr.report_to))
    problems += data.check_data(cfg.data)
    if not str(cfg.model.name_or_path).strip():
        problems.append("model.name_or_path is empty; set a hub id, a local folder or builtin:tiny.")
    problems += check_template_kwargs(cfg.model.chat_template_kwargs)
    problems += adapters.check_adapter(cfg.adapter, tr)
    problems += _validate_rewards(cfg.reward) if cfg.reward or not cfg.loss.teacher_kl else []
    problems += _teacher_problems(cfg)
    problems += check_sft(cfg)
    problems += check_band(cfg)
    problems += samplers.validate(cfg)  # (its name; then each backend validates its own keys)
    if not unused_ok:
        problems += unused_settings(cfg)
    return problems


def _value_problems(cfg: Any) -> list[str]:
    """Options that are none of their choices, counts below 1, amounts below 0."""
    problems = []
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
    return problems


def _micro_batch_problems(tr: Any, G: int, W: int) -> list[str]:
    """Micro-batches hold whole groups: the rows of one prompt's G completions stay together
    (ref 004: "batch size must be a multiple of num_generations"). With W processes each rank
    trains on prompts_per_step / W prompts in gradient_accumulation_steps micro-batches."""
    limit = tr.memory_limit_gib
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        return [
            f"trainer.memory_limit_gib={limit:g} must be a positive number of GiB, e.g. 16, or null (the free memory)."
        ]
    if limit is not None and tr.micro_batch_tokens != "auto":
        return [
            f"trainer.memory_limit_gib={limit:g} is the limit trainer.micro_batch_tokens=auto plans for, but "
            f"trainer.micro_batch_tokens={tr.micro_batch_tokens}. Set trainer.micro_batch_tokens=auto, or drop "
            "trainer.memory_limit_gib."
        ]
    if tr.micro_batch_tokens is not None:
        return _token_budget_problems(tr, W)
    P, A = tr.prompts_per_step, tr.gradient_accumulation_steps
    if not (P >= 1 and A >= 1 and W >= 1 and P % (A * W) != 0):
        return []
    if W == 1:
        return [
            f"trainer.prompts_per_step={P} is not divisible by trainer.gradient_accumulation_steps={A}: "
            f"each micro-batch must hold whole groups of sampler.num_generations={G} completions, "
            f"i.e. {P}*{G}={P * G} completions cannot split into {A} micro-batches of whole groups. "
            f"Set gradient_accumulation_steps to a divisor of {P} (e.g. 1) or prompts_per_step to a "
            f"multiple of {A}."
        ]
    return [
        f"trainer.prompts_per_step={P} cannot be shared by {W} processes with "
        f"trainer.gradient_accumulation_steps={A}: each process trains on whole groups of "
        f"sampler.num_generations={G} completions, prompts_per_step / processes of them, in "
        f"{A} micro-batches, so prompts_per_step must be a multiple of {A}*{W}={A * W}. Set "
        f"trainer.prompts_per_step={max(A * W, (P // (A * W) + 1) * A * W)} (or another multiple of "
        f"{A * W}), or use fewer processes or accumulation steps."
    ]


def _token_budget_problems(tr: Any, W: int) -> list[str]:
    """trainer.micro_batch_tokens: a positive count that replaces gradient_accumulation_steps."""
    problems = []
    budget = tr.micro_batch_tokens
    if budget != "auto" and not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        problems.append(
            f"trainer.micro_batch_tokens={budget} must be a positive number of tokens: the "
            "most one micro-batch's forward runs (each group's prompt once plus its completions, padding "
            "included), e.g. 4096; auto to have it measured for this device before step 1; or null to "
            "split the step by trainer.gradient_accumulation_steps."
        )
    if tr.gradient_accumulation_steps != 1:
        problems.append(
            f"trainer.gradient_accumulation_steps={tr.gradient_accumulation_steps} is ignored with "
            f"trainer.micro_batch_tokens={tr.micro_batch_tokens}: the budget decides how many micro-batches "
            "a step runs. Drop one of them."
        )
    if W > 1 and tr.prompts_per_step % W:
        problems.append(
            f"trainer.prompts_per_step={tr.prompts_per_step} cannot be shared by {W} processes: each samples "
            f"prompts_per_step / processes prompts. Set it to a multiple of {W}."
        )
    return problems


def _frozen_precision_problems(tr: Any) -> list[str]:
    """trainer.frozen_precision=bf16 needs bf16 arithmetic, which fp16's GPUs lack."""
    if tr.frozen_precision == "bf16" and tr.precision == "fp16":
        return [
            "trainer.frozen_precision=bf16 with trainer.precision=fp16: fp16 is for GPUs without bf16, "
            "where a bf16 reference or teacher cannot run; set trainer.frozen_precision=same (they "
            "then run under fp16 autocast as the policy does)."
        ]
    return []


def _has_frozen_model(cfg: Any) -> bool:
    """A frozen model of its own is loaded (frozen.py): a reference under full fine-tuning with
    loss.beta > 0 (under LoRA the reference is the policy with its adapters disabled), or a teacher."""
    return (cfg.loss.beta > 0 and cfg.adapter.name == "none") or bool(cfg.teacher.name_or_path)


def _unused_frozen_precision(cfg: Any) -> list[str]:
    """trainer.frozen_precision=bf16 where it changes nothing: no frozen model of its own is loaded,
    or the policy's weights are bf16 already (trainer.precision=bf16)."""
    tr = cfg.trainer
    if tr.frozen_precision != "bf16":
        return []
    if not _has_frozen_model(cfg):
        why = (
            f"loss.beta={cfg.loss.beta} and adapter.name={cfg.adapter.name}: the reference is the policy "
            "itself, with its adapters disabled, and there is no teacher"
            if cfg.loss.beta > 0
            else "loss.beta=0 (no reference) and no teacher"
        )
        return [
            f"trainer.frozen_precision=bf16 is ignored here: it stores the frozen models (the KL reference, "
            f"a teacher) in bf16, and this run loads none: {why}. Drop trainer.frozen_precision (or set "
            "loss.beta > 0 under adapter=none, or a teacher)."
        ]
    if tr.precision == "bf16":
        return [
            "trainer.frozen_precision=bf16 is ignored with trainer.precision=bf16: the reference and the "
            "teacher are stored in bf16 already (as the policy's weights); drop trainer.frozen_precision."
        ]
    return []


def _teacher_problems(cfg: Any) -> list[str]:
    """loss.teacher_kl and teacher.name_or_path go together (on-policy distillation)."""
    kl, name = cfg.loss.teacher_kl, cfg.teacher.name_or_path
    if not math.isfinite(kl) or kl < 0:
        return [
            f"loss.teacher_kl={kl} must be a number >= 0 (the weight of the reverse KL to the teacher; 0: none)."
        ]
    if kl > 0 and not name:
        return [
            f"loss.teacher_kl={kl} weighs the reverse KL to a teacher, and teacher.name_or_path is not set: "
            "name the teacher (a hub id, a folder such as a grpo-cli checkpoint), or set loss.teacher_kl=0."
        ]
    if name and not kl > 0:
        return [
            f"teacher.name_or_path={name!r} is set, and loss.teacher_kl=0 leaves it out of the loss (it would "
            "load and score for nothing): set loss.teacher_kl (e.g. 1.0 for distillation alone, 0.1 beside "
            "the rewards), or drop teacher.name_or_path."
        ]
    return []


def _validate_rewards(reward: Any) -> list[str]:
    if not reward:
        return [
            "no reward is configured: GRPO needs at least one; choose some with 'reward=[accuracy,format]'."
        ]
    from grpo_cli.rewards import check_rewards  # names, import paths, weights, options

    return check_rewards(reward)


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


def inert_settings(cfg: Any, keys: list[str]) -> list[str]:
    """Of `keys` (the command line's, as `loss.epsilon`), those that cannot change this run's
    training, each with why and what would make it act: a sweep over one trains alike jobs."""
    from grpo_cli.errors import UserError
    from grpo_cli.samplers import plugin as sampler_plugin

    notes = []
    try:
        exact = sampler_plugin(cfg.sampler.backend).facts.exact_draw
    except UserError:  # (validation names the backend)
        return []
    if cfg.trainer.num_iterations == 1 and exact:
        for key in ("loss.epsilon", "loss.epsilon_high"):
            if key in keys:
                notes.append(
                    f"{key} has no effect here: with trainer.num_iterations=1 and an exact sampler the policy "
                    "that sampled is the one updated, so the ratio is 1 and the clip never acts (jobs that "
                    "differ only in it train alike); set trainer.num_iterations=2 or more for it to act."
                )
    return notes


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
    else:  # (the generator's keys are the arithmetic source's alone)
        for key, value in _changed(d, DataConfig(), _GENERATOR_KEYS):
            why = (
                "it sizes the built-in arithmetic generator, and another source sets its own rows "
                "(trainer.max_steps and trainer.epochs set how many are trained on)"
                if key == "num_examples"
                else "it shapes the built-in arithmetic generator's problems"
            )
            problems.append(
                f"data.{key}={_shown(value)} is ignored by data.source={d.source}: {why}; choose "
                f"data=arithmetic to train on generated problems, otherwise drop data.{key}."
            )
    problems += _unused_file_keys(d)
    if d.source == "hub" and d.eval_split is not None and d.eval_size != DataConfig().eval_size:
        problems.append(
            f"data.eval_size={d.eval_size} is ignored with data.eval_split={_shown(d.eval_split)}: the "
            "whole split is evaluated; set data.eval_split=null to hold out data.eval_size rows of the "
            "training split instead, otherwise drop data.eval_size."
        )

    from grpo_cli import samplers

    known_backend = not samplers.plugin_problems(cfg.sampler.backend)
    correction = samplers.sampler_correction(lo, cfg.sampler) if known_backend else lo.sampler_correction
    if correction == "none" and lo.tis_cap != LossConfig().tis_cap:
        shown = (
            "none"
            if lo.sampler_correction == "none"
            else f"auto (none under sampler.backend={cfg.sampler.backend})"
        )
        problems.append(
            f"loss.tis_cap={lo.tis_cap} is ignored with loss.sampler_correction={shown} (it caps the truncated "
            "importance-sampling weights): choose loss.sampler_correction=tis to correct for the "
            "sampler's numerics, otherwise drop loss.tis_cap."
        )
    if correction != "sequence_mask" and lo.tis_min is not None:
        problems.append(
            f"loss.tis_min={lo.tis_min} is read by loss.sampler_correction=sequence_mask alone (the lower "
            f"bound of a sequence's ratio), and it is {correction}: choose sequence_mask, otherwise drop "
            "loss.tis_min."
        )
    if known_backend:
        foreign = samplers.foreign_keys(cfg.sampler.backend)
        for key, value in _changed(cfg.sampler, SamplerConfig(), tuple(foreign)):
            owner = foreign[key]
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
    problems += _unused_environment(cfg.environment)
    problems += _unused_frozen_precision(cfg)
    if cfg.sft.name == "none":
        for key, value in _changed(
            cfg.sft, SftConfig(), tuple(f.name for f in dataclasses.fields(SftConfig))[1:]
        ):
            problems.append(
                f"sft.{key}={_shown(value)} is ignored with sft=none (no warm-up runs): choose sft=demonstrations "
                f"(grpo-train sft=demonstrations sft.{key}={_cli(value)}), otherwise drop sft.{key}."
            )
    if d.pass_rate_band is None and d.band_samples != DataConfig().band_samples:
        problems.append(
            f"data.band_samples={d.band_samples} is ignored without data.pass_rate_band (the samples a prompt's "
            "pass rate is measured from): set data.pass_rate_band=[0.2,0.8], otherwise drop data.band_samples."
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


def _unused_file_keys(d: Any) -> list[str]:
    """The hub keys data.source=file does not read (subset, split) or must not (eval_split)."""
    if d.source != "file":
        return []
    problems = []
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
    return problems


def _unused_environment(env: Any) -> list[str]:
    """The environment keys that another style alone reads (its facts.keys: environment.env_config
    and reward_turns, text_gym's), set under this one. None under a style that is not found (its
    name is the problem then: environments.check_environment)."""
    from grpo_cli.environments import styles
    from grpo_cli.errors import UserError

    try:
        foreign = styles.foreign_keys(env.style)
    except UserError:
        return []
    return [
        f"environment.{key}={_shown(value)} is ignored with environment.style={env.style} (only "
        f"environment.style={foreign[key]} reads it): choose environment.style={foreign[key]}, otherwise "
        f"drop environment.{key}."
        for key, value in _changed(env, EnvironmentConfig(), tuple(foreign))
    ]
