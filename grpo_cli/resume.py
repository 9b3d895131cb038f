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

# The keys that define the weights a checkpoint continues (the model, and the shape of its
# adapters): they may not change on resume. Everything else may (with a note that the run no
# longer reproduces exactly).
MODEL_IDENTITY_KEYS = ("name_or_path", "gguf_file", "revision", "tokenizer")
ADAPTER_IDENTITY_KEYS = ("name", "r", "alpha", "target_modules", "quantization")
# Keys that do not change what is computed; changing them on resume is not worth a note.
_COSMETIC_KEYS = {
    "trainer.resume",
    "trainer.quiet",
    "trainer.logging_steps",
    "trainer.save_steps",
    "trainer.keep_last",
    "trainer.max_bad_steps",
    "trainer.self_check",
    "trainer.eval_before",
    "model.offline_wheel",
    "model.offline_gguf",
    "model.trust_remote_code",
    "trainer.report_to",
    "trainer.distributed_timeout_s",
    "trainer.distributed_timeout",  # (its old name: a checkpoint saved before the rename has it)
}


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
    changed = check_resume_config(resume_from, OmegaConf.to_container(OmegaConf.structured(cfg)))
    return Resume(resume_from, ckpt.load_training_state(resume_from), changed)


def check_resume_config(path: Path, current: dict[str, Any]) -> list[str]:
    """Refuse to resume a checkpoint with a different model; return the other settings that
    differ from the checkpoint's (`key: old -> new`), which are allowed."""
    import yaml

    try:
        saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(
            f"checkpoint {path} has an unreadable config.yaml ({first_line(exc)}); "
            "resume from an earlier checkpoint."
        ) from exc
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise UserError(
            f"checkpoint {path} has no model section in its config.yaml: it was not written "
            "by this version of grpo-train; start a new run instead."
        )
    for key in MODEL_IDENTITY_KEYS:
        old, new = saved["model"].get(key), current["model"].get(key)
        if not _same_model_value(old, new):
            raise UserError(
                f"checkpoint {path} was trained from model.{key}={old!r}, but this run sets "
                f"model.{key}={new!r}. A resumed run continues the checkpoint's weights, so "
                f"model.{key} must stay the same: drop that override (or set model.{key}={old}), or start "
                "a new run (a new hydra.run.dir, no trainer.resume) to train the other model."
            )
    saved_adapter, adapter = saved.get("adapter") or {"name": "none"}, current.get("adapter") or {}
    for key in ADAPTER_IDENTITY_KEYS if saved_adapter.get("name") != "none" else ("name",):
        old, new = saved_adapter.get(key), adapter.get(key)
        if old != new:
            raise UserError(
                f"checkpoint {path} was trained with adapter.{key}={old!r}, but this run sets "
                f"adapter.{key}={new!r}. A resumed run continues the checkpoint's "
                f"{'adapters' if saved_adapter.get('name') != 'none' else 'full weights'}, so adapter.{key} must "
                f"stay the same: drop that override (or set adapter.{key}={old}), or start a new run."
            )
    changed = []
    for key, old in _flatten(saved).items():
        new = _flatten(current).get(key, "<absent>")
        if key not in _COSMETIC_KEYS and old != new:
            changed.append(f"{key}: {old!r} -> {new!r}")
    return changed


def _same_model_value(old, new) -> bool:
    if old == new:
        return True
    if isinstance(old, str) and isinstance(new, str):
        a, b = Path(old).expanduser(), Path(new).expanduser()
        if a.exists() and b.exists():
            return a.resolve() == b.resolve()
    return False


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def restore(resume: Resume, policy, opt_step, stream, *, fsdp: bool, d, console):
    """A resumed run's optimizer, schedule and prompt stream, from the checkpoint's training
    state (resume.loaded), and what differs from its run (resume.changed), said. A checkpoint of
    the warm-up (sft-N, sft-end: before GRPO's first step) leaves GRPO's optimizer and stream fresh
    (the warm-up's optimizer is restored by stages.py)."""
    resume_from, loaded, changed = resume
    state = loaded[0]
    grpo = state.step > 0
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
    stopped = (state.early or {}).get("stopped_at", 0) if loaded else 0
    complete = None
    if stopped and state.step == stopped:
        complete = (
            f"early stopping ended it at step {stopped} ({resume_from}); nothing was changed. Raise "
            "trainer.early_stopping_patience (or drop it) in a new run to train further."
        )
    elif loaded and state.step == total_steps:
        complete = (
            f"{resume_from} is step {total_steps} of {total_steps}; nothing was changed. Raise trainer.max_steps "
            "to train further."
        )
    if complete is not None:
        if d.is_main:
            print(f"grpo-train: the run is already complete: {complete}", file=sys.stderr, flush=True)
        return None
    if state.step > total_steps:
        raise UserError(
            f"checkpoint {resume_from} is at step {state.step}, and this run ends at step {total_steps} "
            f"(trainer.max_steps={t.max_steps}, trainer.epochs={t.epochs}, {steps_per_epoch} steps per epoch): "
            f"it is past the end. Raise trainer.max_steps (or trainer.epochs) above {state.step} to continue it."
        )
    return total_steps, state
