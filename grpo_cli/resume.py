"""Where a run stands: the checkpoint it resumes from (trainer.resume) and what differs from its
run, how far the run goes and where it starts, and the optimizer, schedule and prompt stream
restored from that checkpoint. build.py calls these while it builds a run."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import OmegaConf

from grpo_cli import checkpoint as ckpt
from grpo_cli.config import Config
from grpo_cli.distributed import Dist
from grpo_cli.errors import UserError, first_line


class Resume(NamedTuple):
    """The checkpoint a run resumes from (None without trainer.resume), its loaded training state
    (checkpoint.load_training_state's; None) and the settings that differ from its run's ([])."""

    path: Path | None
    loaded: Any
    changed: list[str]


def resume_state(cfg: Config, run_dir: Path, fsdp: bool) -> Resume:
    """The Resume of trainer.resume; refuses a checkpoint of the other distributed mode."""
    if not cfg.trainer.resume:
        return Resume(None, None, [])
    resume_from = ckpt.find_resume_checkpoint(cfg.trainer.resume, run_dir)
    if ckpt.is_sharded_checkpoint(resume_from) != fsdp:
        written, now = ("fsdp", "ddp") if not fsdp else ("ddp (or one process)", "fsdp")
        raise UserError(
            f"checkpoint {resume_from} was written with trainer.distributed={written}, and this run uses "
            f"{now}: their optimizer states are stored differently (FSDP's sharded over the processes). "
            f"Resume it with trainer.distributed={written.split()[0]}"
            + (" and trainer.num_processes >= 2" if not fsdp else "")
            + ", or start a new run from its weights (model.name_or_path=<the checkpoint folder>)."
        )
    changed = ckpt.check_resume_config(resume_from, OmegaConf.to_container(OmegaConf.structured(cfg)))
    return Resume(resume_from, ckpt.load_training_state(resume_from), changed)


def restore(resume: Resume, policy, opt_step, stream, *, fsdp: bool, d, console, grpo: bool = True):
    """A resumed run's optimizer, schedule and prompt stream, from the checkpoint's training
    state (resume.loaded), and what differs from its run (resume.changed), said. grpo=False: a
    checkpoint of the warm-up (sft-N, sft-end), before GRPO's first step: GRPO's optimizer and
    stream start fresh (the warm-up's optimizer is restored by stages.py)."""
    resume_from, loaded, changed = resume
    state = loaded[0]
    try:
        if grpo and fsdp:
            ckpt.load_sharded(resume_from, policy, opt_step.optimizer)
        elif grpo:
            opt_step.optimizer.load_state_dict(loaded[1])
        if grpo:
            opt_step.scheduler.load_state_dict(loaded[2])
            stream.load_state(state.stream)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
        raise UserError(
            f"checkpoint {resume_from}: its optimizer/scheduler state does not fit this "
            f"model and optimizer ({first_line(exc, 160)}); resume with the checkpoint's own "
            "model and optimizer settings, or start a new run."
        ) from exc
    where = (
        f"step {state.step}"
        if grpo
        else ("the end of the warm-up" if state.sft_done else f"warm-up step {state.sft_step}")
    )
    console.print(f"resumed from {resume_from} at {where}")
    if state.world_size != d.world_size:
        console.print(
            f"[yellow]the checkpoint was written by {state.world_size} process(es), this run has "
            f"{d.world_size}: it continues (the completions do not depend on the number of processes), "
            "but the micro-batches' order and float sums differ from an uninterrupted run's.[/]"
        )
    if changed:
        console.print(
            "[yellow]settings differ from the checkpoint's (allowed; later steps will not "
            "match an uninterrupted run exactly): " + "; ".join(changed) + "[/]"
        )


def run_length(
    cfg: Config, resume: Resume, train_prompts: int, d: Dist
) -> tuple[int, ckpt.TrainerState] | None:
    """The run's total steps (train_prompts: the training prompts an epoch holds) and where it
    starts (step 0, or the resumed checkpoint's state); None when the checkpoint to resume already
    ends the run (said on stderr). Refuses one past the end."""
    t, (resume_from, loaded, _) = cfg.trainer, resume
    steps_per_epoch = math.ceil(train_prompts / t.prompts_per_step)
    total_steps = min(t.max_steps, t.epochs * steps_per_epoch)
    state = loaded[0] if loaded else ckpt.TrainerState()
    if loaded and state.step == total_steps:
        if d.is_main:
            print(
                f"grpo-train: the run is already complete ({resume_from} is step {total_steps} of {total_steps}); "
                "nothing was changed. Raise trainer.max_steps to train further.",
                file=sys.stderr,
                flush=True,
            )
        return None
    if state.step > total_steps:
        raise UserError(
            f"checkpoint {resume_from} is at step {state.step}, and this run ends at step {total_steps} "
            f"(trainer.max_steps={t.max_steps}, trainer.epochs={t.epochs}, {steps_per_epoch} steps per epoch): "
            f"it is past the end. Raise trainer.max_steps (or trainer.epochs) above {state.step} to continue it."
        )
    return total_steps, state
