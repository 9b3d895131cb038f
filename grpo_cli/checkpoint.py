"""Checkpoints: written to a temporary folder and renamed into place, so a crash never leaves a
half-written checkpoint that looks complete; resume; keep-last rotation.

Layout of `<run>/checkpoints/step-000050/`: the model (safetensors) and tokenizer as
`save_pretrained` writes them (loadable with AutoModelForCausalLM.from_pretrained),
`optimizer.pt`, `scheduler.pt`, `trainer_state.pt` (step, data position, every RNG state) and
the resolved `config.yaml`.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from grpo_cli.errors import UserError

STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"python": list(_flatten_py_state(random.getstate())), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _flatten_py_state(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, *, model, tokenizer, optimizer, scheduler,
                    trainer_state: dict[str, Any], config_yaml: str, keep_last: int) -> Path:
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. final save == periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write checkpoint {final}: {exc}. Free disk space or point "
                        "hydra.run.dir at a disk with room; earlier checkpoints are intact.") from exc
    _rotate(root, keep_last)
    return final


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _rotate(root: Path, keep_last: int) -> None:
    steps = list_checkpoints(root.parent)
    for old in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are never listed)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)
             and (p / "trainer_state.pt").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_resume_checkpoint(resume: str, run_dir: Path) -> Path:
    """`auto`: the latest checkpoint in this run's folder; else a checkpoint or run folder."""
    if resume == "auto":
        found = list_checkpoints(run_dir)
        if not found:
            raise UserError(f"trainer.resume=auto found no checkpoint in {checkpoints_dir(run_dir)}. "
                            "Resume by running with hydra.run.dir=<the run folder> trainer.resume=auto, "
                            "or give trainer.resume=<checkpoint folder>.")
        return found[-1]
    path = Path(resume).expanduser()
    if path.is_dir() and not (path / "trainer_state.pt").is_file():
        found = list_checkpoints(path)
        if found:
            return found[-1]
    if not (path / "trainer_state.pt").is_file():
        raise UserError(f"trainer.resume={resume!r} is not a grpo-cli checkpoint (no trainer_state.pt); "
                        "give a folder like outputs/.../checkpoints/step-000050 or its run folder.")
    return path


def load_training_state(path: Path) -> tuple[dict, dict, dict]:
    """(trainer_state, optimizer state, scheduler state), loaded with weights_only=True: a
    checkpoint can hold tensors and plain containers, never arbitrary pickled objects."""
    try:
        trainer_state = torch.load(path / "trainer_state.pt", weights_only=True)
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
        scheduler_state = torch.load(path / "scheduler.pt", weights_only=True)
    except Exception as exc:
        raise UserError(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {exc}); "
                        "resume from an earlier one.") from exc
    return trainer_state, optimizer_state, scheduler_state
