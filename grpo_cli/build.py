"""Config -> plain objects: data, tokenizer, models, the sampler, the optimizer step, rewards, and
a resumed run's state.

grpo-train (build_training) and grpo-eval (cli/eval.py) share one set-up, build_front: cheap
checks first (a bad reward, device, precision, checkpoint or data file fails before any model is
loaded), the seed, then the tokenizer and the tokenised data; then build_rollouts. Frozen models
(the reference, the teacher) load one way: frozen.load_frozen.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli import checkpoint as ckpt
from grpo_cli.adapters import (
    add_lora,
    check_quantization,
    is_adapted,
    load_lora,
    trainable_summary,
)
from grpo_cli.chat_template import with_template_kwargs
from grpo_cli.config import Config, DataConfig
from grpo_cli.data import (
    Example,
    Formatting,
    PromptData,
    PromptStream,
    build_prompts,
    read_rows,
    to_examples,
    validation_rows,
    wide_eval_rows,
)
from grpo_cli.data import plugin as data_source
from grpo_cli.distributed import Dist, shard_model, wrap_scorer
from grpo_cli.environments.episodes import environment_episodes
from grpo_cli.errors import UserError
from grpo_cli.evaluate import check_group_by
from grpo_cli.frozen import model_kw, reference, teacher_model
from grpo_cli.logprobs import TokenLogprobs
from grpo_cli.models import (
    TESTED_MODEL_TYPES,
    ModelSource,
    load_model,
    load_tokenizer,
    model_type,
    recurrent,
    resolve_source,
    tested_architecture,
)
from grpo_cli.optim import OptimizerStep, build_optimizer
from grpo_cli.packing import scoring_plan
from grpo_cli.precision import (
    MasterWeights,
    Precision,
    emulation_note,
    resolve_device,
    resolve_precision,
    to_weights_dtype,
)
from grpo_cli.replay import open_saved
from grpo_cli.resume import Resume, restore, resume_state, run_length
from grpo_cli.rewards import Rewards, build_rewards, check_reward_columns
from grpo_cli.roles import Learner, Rollouts
from grpo_cli.samplers import Context as SamplerContext
from grpo_cli.samplers import build_sampler
from grpo_cli.sft import read_demonstrations
from grpo_cli.teacher import teacher_source


def read_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows that cfg.data names (no tokenizer needed)."""
    return read_rows(cfg.data, cfg.trainer.seed)


def build_tokenizer(cfg: Config, log) -> tuple[ModelSource, Any]:
    """Where cfg.model's weights come from (printing the source) and its tokenizer, carrying
    model.chat_template_kwargs for every rendering of its chat template (chat_template.render)."""
    m = cfg.model
    source = resolve_source(
        m.name_or_path, m.gguf_file, offline_wheel=m.offline_wheel, offline_gguf=m.offline_gguf, log=log
    )
    tokenizer = load_tokenizer(
        source,
        chat_template=m.chat_template,
        tokenizer_path=m.tokenizer,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
    )
    return source, with_template_kwargs(tokenizer, m.chat_template_kwargs)


def read_wide_eval(cfg: Config) -> list[dict]:
    """The second held-out set's rows (the data source's, e.g. arithmetic's wide operands), or []."""
    return wide_eval_rows(cfg.data, cfg.trainer.seed)


def build_wide_eval(cfg: Config, rows: list[dict], tokenizer) -> list[Example]:
    """Tokenised prompts of the second held-out set, formatted as the held-out split is."""
    formatting = Formatting.of(cfg.data, cfg.sampler.max_prompt_length)
    return to_examples(rows, tokenizer, formatting, "the wide held-out set")


def build_data(cfg: Config, rows: tuple[list[dict], list[dict]], tokenizer):
    """Tokenised prompts (chat template, long-prompt rule) from the rows of read_data."""
    d = cfg.data
    formatting = Formatting.of(d, cfg.sampler.max_prompt_length)
    if cfg.environment.style == "trl" and cfg.environment.fn:  # the environment may own the task
        formatting = dataclasses.replace(formatting, missing_prompt=[{"role": "user", "content": ""}])
    return build_prompts(rows, tokenizer, formatting, f"data ({d.source} {d.path or ''})".strip())


def eos_token_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


def seed_everything(seed: int) -> None:
    """Python's, torch's and NumPy's global generators (the sampler draws from torch's)."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return
    np.random.seed(seed)


def load_policy(
    cfg: Config, source: ModelSource, device, precision: Precision, *, trainable: bool, resume_from=None
):
    """The model to train or evaluate: the base model from `source`, with cfg.adapter's LoRA
    adapters when it asks for them (fresh, or loaded from adapter.path or the checkpoint to resume).
    Without adapters, a checkpoint to resume is itself the full model to load."""
    a, gc = cfg.adapter, cfg.trainer.gradient_checkpointing and trainable
    if a.name == "none":
        where = ModelSource(str(resume_from), None, f"checkpoint {resume_from}") if resume_from else source
        key = "trainer.resume" if resume_from else "model.name_or_path"
        model = load_model(
            where, device=device, trainable=trainable, gradient_checkpointing=gc, key=key, **model_kw(cfg)
        )
        # Loaded in fp32 either way: a model to train keeps these fp32 values as its master
        # weights (build_training); one to evaluate is stored in the precision's dtype now.
        if not trainable and precision.weights_dtype is not None:
            to_weights_dtype(model, precision.weights_dtype)
        return model
    import torch

    quantized = a.quantization == "4bit"
    check_quantization(a.quantization, device)
    # The frozen base needs no fp32 master copy: under bf16/fp16 it is stored in that dtype (half
    # the memory, and the CPU's bf16 units run it); the adapters stay fp32 (PEFT's default).
    half = {"bf16": torch.bfloat16, "bf16-autocast": torch.bfloat16, "fp16": torch.float16}.get(
        precision.name
    )
    base = load_model(
        source,
        device=device,
        trainable=trainable,
        gradient_checkpointing=gc and not quantized,
        dtype=half or torch.float32,
        quantize_4bit=quantized,
        **model_kw(cfg),
    )
    saved = resume_from or a.path
    if saved:
        model = load_lora(base, saved, trainable=trainable, quantized=quantized, gradient_checkpointing=gc)
    else:
        model = add_lora(base, a, quantized=quantized, gradient_checkpointing=gc)
    if not trainable:
        model.eval()
    return model


@dataclass
class Parts:
    """What grpo-train runs on: its two roles (roles.Rollouts draws and scores, roles.Learner
    learns), its held-out sets, and where the run stands."""

    rollouts: Rollouts
    learner: Learner
    eval_examples: list[Example]  # held-out prompts
    wide_eval_examples: list[Example]  # the second held-out set (operands outside training's), or []
    total_steps: int
    state: ckpt.TrainerState  # where the run starts (step 0, or the resumed checkpoint's)
    resumed_from: Path | None
    dist: Dist  # this process's place among the ranks
    # What the stages before the first GRPO step read (stages.py): the checkpoint resumed (its
    # loaded optimizer state: a warm-up's), where the models run, every training prompt (the
    # band chooses among them), and the warm-up's demonstrations (None: no warm-up to run).
    resume: Resume = Resume(None, None, [])
    placement: Placement | None = None
    train_examples: list[Example] = dataclasses.field(default_factory=list)
    demonstrations: Any = None
    val_examples: list[Example] = dataclasses.field(default_factory=list)  # data.val_size's rows, or []


@dataclass(frozen=True)
class Placement:
    """Where the rollouts' parts run: the precision, the device, this process's rank (None:
    grpo-eval, one process)."""

    precision: Precision
    device: Any
    dist: Dist | None = None


def build_rollouts(cfg: Config, model, tokenizer, rewards: Rewards, at: Placement, stream=None) -> Rollouts:
    """The sampler of sampler.backend over `model`, the configured environment's episodes (None
    without one) and the rewards, opened on at.device: what grpo-train and grpo-eval draw and
    score with. `stream`: the training prompts (None: grpo-eval)."""
    precision, device, d = at.precision, at.device, at.dist
    eos_ids = eos_token_ids(tokenizer, model)
    context = SamplerContext(
        policy=model,
        eos_ids=eos_ids,
        pad_id=tokenizer.pad_token_id,
        precision=precision,
        fast_decode=tested_architecture(model),
        seed=cfg.trainer.seed,
        tokenizer=tokenizer,
    )
    sampler = build_sampler(cfg.sampler, context)
    try:  # the environment's tools are checked, and the rewards that have a build load, once per process
        episodes = environment_episodes(
            cfg,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            pad_id=tokenizer.pad_token_id,
            keep_open=rewards.take_environments,
        )
        rewards.open(device, d, dtype=precision.frozen_dtype)
    except BaseException:
        sampler.close()
        raise
    return Rollouts(cfg, sampler, episodes, rewards, tokenizer, stream, d or Dist(), device)


def _grad_scaler(precision: Precision, device, state):
    """fp16's grad scaler, its state restored on resume (from the TrainerState); None otherwise."""
    import torch

    scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
    if scaler is not None and state.grad_scaler:
        scaler.load_state_dict(state.grad_scaler)
    return scaler


def optimizer_step(cfg: Config, policy, masters, scaler, total_steps: int, d):
    """AdamW over the trainable weights (bf16: their fp32 masters) and its schedule, with the grad
    scaler (fp16; else None: _grad_scaler), as one optim.OptimizerStep."""
    optimizer, scheduler = build_optimizer(
        masters.params if masters else policy.parameters(),  # the trainable ones (adapters': theirs)
        cfg.optimizer,
        total_updates=total_steps * cfg.trainer.num_iterations,
    )
    return OptimizerStep(
        optimizer,
        scheduler,
        policy=policy,
        masters=masters,
        grad_scaler=scaler,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        dist=d,
    )


def _data_summary(cfg: Config, data, wide_eval) -> str:
    """The run's data line: prompts for training and held out, the wide set, what was dropped."""
    s = cfg.sampler
    return (
        f"data: {len(data.train)} training prompts, {len(data.eval)} held-out"
        + (
            f" and {len(wide_eval)} wide held-out (operands up to {cfg.data.wide_eval_max_operand})"
            if wide_eval
            else f" (no wide held-out set: data.wide_eval_max_operand={cfg.data.wide_eval_max_operand} is not "
            f"above data.max_operand={cfg.data.max_operand})"
            if data_source(cfg.data.source).facts.wide_eval
            and cfg.data.wide_eval_max_operand
            and cfg.data.eval_size
            else ""
        )
        + (
            f"; {data.dropped} dropped as longer than max_prompt_length={s.max_prompt_length}"
            if data.dropped
            else ""
        )
        + (f"; {data.truncated} truncated on the left" if data.truncated else "")
    )


def _recurrent_note(policy) -> str:
    return (
        f"note: model type {model_type(policy)!r} keeps a recurrent or convolution state beside attention: "
        "its training forwards run each row's prompt in full (a state is not shared by repeating a "
        "prompt's cache), the sampler prefills each prompt once per completion, multi-turn sessions "
        "read each row's history again every turn, and a completion with holes is scored with its "
        "attended tokens moved together (docs/models.md, hybrid models)."
    )


def _untested_note(policy) -> str:
    return (
        f"note: model type {getattr(policy.config, 'model_type', None)!r} is not among the architectures "
        f"grpo-cli is tested on ({', '.join(TESTED_MODEL_TYPES)}); it trains through the plain paths "
        "(no shared-prompt KV cache, no decode-time W @ x^T layers), and the step-0 self-check checks its "
        "log-probs."
    )


def _placement(cfg: Config, d: Dist | None) -> Placement:
    """The device (under several processes on GPUs, this rank's) and precision, with the checks
    they allow before anything loads (4-bit on this device, fp16 under FSDP2). d None: grpo-eval."""
    t, rank = cfg.trainer, d or Dist()
    device = resolve_device(t.device)
    if rank.enabled and device.type == "cuda":  # one GPU per process
        import torch

        device = torch.device("cuda", rank.local_rank)
    precision = resolve_precision(t.precision, device, adapted=cfg.adapter.name != "none")
    check_quantization(cfg.adapter.quantization, device)
    if rank.enabled and t.distributed == "fsdp" and precision.use_grad_scaler:
        raise UserError(
            f"trainer.distributed=fsdp with trainer.precision={precision.name} needs a sharded grad "
            "scaler, which grpo-cli does not run; use trainer.precision=bf16 (or fp32), or "
            "trainer.distributed=ddp."
        )
    return Placement(precision, device, d)


def _fsdp(cfg: Config, d: Dist | None) -> bool:
    """Whether the models are sharded under FSDP2: several processes and trainer.distributed=fsdp."""
    return d is not None and d.enabled and cfg.trainer.distributed == "fsdp"


@dataclass(frozen=True)
class Front:
    """What grpo-train and grpo-eval both set up before any model loads (build_front)."""

    rewards: Rewards
    at: Placement  # the precision, the device (and grpo-train's rank)
    source: ModelSource  # where the model's weights come from
    tokenizer: Any
    data: PromptData  # tokenised prompts: .train, .eval (held out), what was dropped or truncated
    wide_eval: list[Example]  # the second held-out set (operands outside training's), or []
    resume: Resume  # grpo-train's checkpoint to resume (Resume(None, None, []): none)
    teacher: ModelSource | None  # grpo-train's teacher's weights (teacher_source), None without one
    val: list[Example] = dataclasses.field(default_factory=list)  # data.val_size's validation set, or []


def build_front(
    cfg: Config,
    log,
    d: Dist | None = None,
    *,
    command: str,
    none_ok: bool = False,
    run_dir: Path | None = None,
) -> Front:
    """The one set-up of grpo-train and grpo-eval, in this order: the rewards, the device and
    precision, the checkpoint to resume, the data rows and their reward columns (cheap checks: no
    tokenizer, no model yet), the seed (seed_everything), the tokenizer (and the teacher's, checked
    against it), the `command`'s model line and emulation note (printed with `log`), the tokenised
    data, data.eval_group_by's check and the wide held-out set. `d`: grpo-train's rank (None:
    grpo-eval's one process); `run_dir`: grpo-train's run folder, where trainer.resume is found
    (None: grpo-eval, nothing resumed and no teacher); none_ok: no reward allowed (distillation)."""
    rewards = build_rewards(cfg.reward, none_ok=none_ok)
    at = _placement(cfg, d)
    training = run_dir is not None
    resume = resume_state(cfg, run_dir, _fsdp(cfg, d)) if training else Resume(None, None, [])
    train_rows, eval_rows = read_data(cfg)
    train_rows, val_rows = validation_rows(cfg.data, train_rows, cfg.trainer.seed)
    wide_rows = read_wide_eval(cfg)
    check_reward_columns(rewards, train_rows + eval_rows, cfg.data)
    seed_everything(cfg.trainer.seed)

    source, tokenizer = build_tokenizer(cfg, log)
    # (the teacher's tokenizer is checked against this one before any model loads)
    teacher = teacher_source(cfg, tokenizer, log) if training else None
    log(f"[bold]{command}[/] device={at.device} precision={at.precision.name} model: {source.description}")
    if note := emulation_note(at.precision, at.device):
        log(note)
    data = build_data(cfg, (train_rows, eval_rows), tokenizer)
    check_group_by(cfg.data.eval_group_by, data.eval, default=DataConfig().eval_group_by)
    wide_eval = build_wide_eval(cfg, wide_rows, tokenizer)
    val = to_examples(
        val_rows, tokenizer, Formatting.of(cfg.data, cfg.sampler.max_prompt_length), "the validation set"
    )
    return Front(rewards, at, source, tokenizer, data, wide_eval, resume, teacher, val)


def _policy(cfg: Config, front: Front, fsdp: bool, console):
    """The policy to train (the resumed checkpoint's weights or adapters, if any) and its fp32
    master weights (bf16 without FSDP2; else None); sharded under FSDP2; its adapters said."""
    at = front.at
    policy = load_policy(
        cfg, front.source, at.device, at.precision, trainable=True, resume_from=front.resume.path
    )
    masters = None
    if fsdp:  # before the optimizer: it steps this process's shards
        # (bf16: FSDP2's mixed precision is the same scheme: fp32 shards, bf16 gathered weights.)
        shard_model(policy, param_dtype=at.precision.weights_dtype)
    elif at.precision.weights_dtype is not None:  # bf16 weights, the fp32 ones become the masters
        masters = MasterWeights(policy, at.precision.weights_dtype)
    if is_adapted(policy):
        console.print(
            f"adapter: LoRA r={cfg.adapter.r} alpha={cfg.adapter.alpha:g} on "
            f"{', '.join(cfg.adapter.target_modules)}; {trainable_summary(policy)}"
        )
    return policy, masters


def _scoring(cfg: Config, policy, fsdp: bool, console):
    """The step's scoring plan (packing.scoring_plan: decided once) and the policy's scorer, its
    notes said (an untested architecture, recurrent layers)."""
    t, s = cfg.trainer, cfg.sampler
    plan = scoring_plan(t, fast_paths=tested_architecture(policy), policy=policy, fsdp=fsdp)
    if not plan.fast_paths:
        console.print(_untested_note(policy))
    if recurrent(policy):
        console.print(_recurrent_note(policy))
    scorer = TokenLogprobs(
        policy,
        temperature=s.temperature,
        shared_prompt=plan.shared_prompt,
        top_k=s.top_k,
        top_p=s.top_p,
        chunk_size=t.logprob_chunk_size,
        entropy_grad=cfg.loss.entropy_coef != 0
        or cfg.loss.use_adaptive_entropy,  # the entropy bonus needs the entropy's gradient
        length_buckets=plan.length_buckets,
    )
    return plan, scorer


def build_fit_probe(cfg: Config, console):
    """grpo-check-env --fit's set-up: what a training step holds, built as grpo-train builds it on
    one process (the data's longest prompt, the policy with its precision and adapter, the
    reference, the teacher, the optimizer, the scorer), without a sampler and with nothing
    resumed. Returns (the learner's parts as fit.fit_budget takes them, the scoring plan, the
    training examples, whether episodes run)."""
    from grpo_cli.environments import environment_factory

    front = build_front(cfg, console.print, command="grpo-check-env --fit")
    policy, masters = _policy(cfg, front, False, console)
    ref = reference(cfg, policy, front.source, front.at, False, None)
    teacher = teacher_model(cfg, teacher_source(cfg, front.tokenizer, console.print), front.at, False)
    scaler = _grad_scaler(front.at.precision, front.at.device, ckpt.TrainerState())
    opt_step = optimizer_step(cfg, policy, masters, scaler, 1, Dist())
    plan, scorer = _scoring(cfg, policy, False, console)
    parts = (policy, scorer, opt_step, front.at.precision, front.at.device)
    multi_turn = environment_factory(cfg.environment) is not None
    return parts, plan, front.data.train, multi_turn, (ref, teacher)


def _fitted(cfg: Config, plan, state, parts, data, run_dir: Path, d: Dist, console):
    """trainer.micro_batch_tokens=auto: the scoring plan with the budget kept in the run's state (a
    resume), else with the one fit.fit_budget's probe chooses now (kept in the state, written to
    memory_plan.json, printed). data: (the training examples, whether episodes run)."""
    from grpo_cli.fit import FitPlan, fit_budget

    if state.fit is not None:
        fit = FitPlan.from_dict(state.fit)
        console.print(f"{fit.line()} (kept from the run's start)")
    else:
        fit = fit_budget(cfg, parts, plan, data[0], data[1], d)
        state.fit = fit.as_dict()
        console.print(fit.line())
        if d.is_main:
            import json

            (run_dir / "memory_plan.json").write_text(json.dumps(fit.as_dict(), indent=1) + "\n")
    return dataclasses.replace(plan, token_budget=fit.budget)


def build_training(cfg: Config, run_dir: Path, console, d: Dist | None = None) -> Parts | None:
    """Everything grpo-train needs: build_front's set-up (cheap checks first, then the tokenizer and
    the data), the run's length, then the models, the optimizer and the two roles. None when the
    checkpoint to resume already ends the run (nothing to do; said on stderr). `d`: this rank."""
    t, d = cfg.trainer, d or Dist()
    none_ok = bool(cfg.loss.teacher_kl)  # (a teacher alone: distillation)
    front = build_front(cfg, console.print, d, command="grpo-train", none_ok=none_ok, run_dir=run_dir)
    console.print(_data_summary(cfg, front.data, front.wide_eval))
    saved = front.resume.loaded[0] if front.resume.loaded else ckpt.TrainerState()
    train = front.data.train if saved.band is None else [front.data.train[i] for i in saved.band]
    if (length := run_length(cfg, front.resume, len(train), d)) is None:
        return None
    total_steps, state = length
    at, resume, fsdp = front.at, front.resume, _fsdp(cfg, d)
    saved = (  # trainer.replay: the saved rollouts, checked before any model loads
        open_saved(cfg, front.rewards, at.device, d.world_size, console.print, run_dir) if t.replay else None
    )
    if saved is not None and state.fit is None and saved.fit is not None:  # (auto: the original's budget)
        state.fit = saved.fit
    precision, device, tokenizer, rewards = at.precision, at.device, front.tokenizer, front.rewards
    demonstrations = None
    if cfg.sft.name != "none" and not state.sft_done and not state.step:  # (before any model loads)
        held_out = [ex.prompt_ids for ex in front.data.eval + front.wide_eval]
        demonstrations = read_demonstrations(cfg, tokenizer, front.data.train, held_out)

    policy, masters = _policy(cfg, front, fsdp, console)
    warmed = Path(state.warmed) if state.sft_done and state.warmed else None
    if warmed is not None and not warmed.is_dir() and (resume.path.parent / ckpt.SFT_END).is_dir():
        warmed = resume.path.parent / ckpt.SFT_END  # (the run folder was moved: its own sft-end)
    ref = reference(cfg, policy, front.source, at, fsdp, warmed)
    teacher = teacher_model(cfg, front.teacher, at, fsdp)

    # (fp16: a warm-up checkpoint's scaler state is the warm-up's own: stages.py restores it)
    scaler = _grad_scaler(precision, device, state if state.step else ckpt.TrainerState())
    opt_step = optimizer_step(cfg, policy, masters, scaler, total_steps, d)
    if saved is not None:  # (after the schedule: it spans the original's steps) the saved ones
        total_steps = min(total_steps, saved.last_step)
    stream = PromptStream(train, seed=t.seed)
    if resume.loaded:  # (GRPO's optimizer and stream once GRPO has stepped; a warm-up's: stages.py)
        restore(resume, policy, opt_step, stream, fsdp=fsdp, d=d, console=console)
    plan, scorer = _scoring(cfg, policy, fsdp, console)
    rollouts = dataclasses.replace(build_rollouts(cfg, policy, tokenizer, rewards, at, stream), saved=saved)
    scorer = wrap_scorer(scorer, d, device)
    if t.micro_batch_tokens == "auto":  # (after every model and the sampler: they hold memory too)
        try:
            parts = (policy, scorer, opt_step, precision, device)
            plan = _fitted(
                cfg,
                plan,
                state,
                parts,
                (front.data.train, rollouts.episodes is not None),
                run_dir,
                d,
                console,
            )
        except BaseException:
            rollouts.close()
            raise
    learner = Learner(
        cfg,
        policy,
        ref,
        scorer,
        opt_step,
        precision,
        plan,
        d,
        device,
        rollouts.sampler.tolerance,
        state,
        teacher,
    )
    return Parts(
        rollouts=rollouts,
        learner=learner,
        # (a replay samples nothing: no evaluation, no validation set)
        eval_examples=front.data.eval if saved is None else [],
        wide_eval_examples=front.wide_eval if saved is None else [],
        val_examples=front.val if saved is None else [],
        total_steps=total_steps,
        state=state,
        resumed_from=resume.path,
        dist=d,
        resume=resume,
        placement=at,
        train_examples=front.data.train,
        demonstrations=demonstrations,
    )
