"""Checkpoints: written to a temporary folder and renamed into place, so a crash (SIGKILL, power
loss, full disk) never leaves a half-written checkpoint that looks complete; resume; keep-last
rotation.

Layout of `<run>/checkpoints/step-000050/`: the model (safetensors) and tokenizer as
`save_pretrained` writes them (loadable with AutoModelForCausalLM.from_pretrained; with
adapter=lora, PEFT's adapter_config.json and adapter_model.safetensors instead of the model),
`optimizer.pt`, `scheduler.pt`, the resolved `config.yaml`, and `trainer_state.pt` (step, data
position, every process's RNG state, grad-scaler state), written last. With
trainer.distributed=fsdp the model and optimizer are sharded over the processes: `sharded/`
holds them as torch.distributed.checkpoint writes them (each process its shard; resumable with
any number of processes) instead of optimizer.pt, and rank 0 still writes the whole model with
save_pretrained.

Crash safety: everything is written and fsynced in `.tmp-step-N-<pid>/`, then renamed to
`step-N/` (one atomic rename). A checkpoint being replaced or rotated away is first renamed to
`.trash-...` and only then deleted, so a folder named `step-N` is always complete. Only folders
named `step-N` holding every file are listed; leftover `.tmp-*`/`.trash-*` folders of a killed
run are ignored and removed by the next save or resume.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_cli.adapters import ADAPTER_FILES, is_adapted
from grpo_cli.errors import UserError, first_line
from grpo_cli.files import fsync_dir, fsync_tree

STEP_DIR = re.compile(r"^step-(\d+)$")
# The warm-up's checkpoints (sft=demonstrations): sft-N inside it, sft-end where it ended (outside
# trainer.keep_last: the warmed weights, which the KL reference and a resume after it read).
SFT_DIR = re.compile(r"^sft-(\d+)$")
SFT_END = "sft-end"
BEST = "best"  # checkpoints/best: the step trainer.best_metric chose (outside keep_last; no optimizer)
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-"
FORMAT_VERSION = 1
# Every file a checkpoint needs besides the weights: a full model's (config.json and
# model.safetensors or its shard index) or a LoRA adapter's (PEFT's adapter_config.json and
# adapter_model.safetensors, which load onto the base model of config.yaml's model section).
REQUIRED_FILES = ("config.yaml", "optimizer.pt", "scheduler.pt", "trainer_state.pt")
SHARDED_DIR = "sharded"  # FSDP: the model and optimizer as torch.distributed.checkpoint writes them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class TrainerState:
    """Everything a resumed run needs besides the weights, the optimizer and the scheduler, saved
    and restored here in one place (`trainer_state.pt`, plus the RNG states at save time)."""

    step: int = 0  # the last completed step
    stream: dict[str, int] = field(default_factory=lambda: {"epoch": 0, "position": 0})  # data position
    grad_scaler: dict[str, Any] = field(default_factory=dict)  # fp16 only
    # Consecutive steps whose loss or gradient was not finite (their updates were skipped), what
    # they were, and the last step whose updates all applied: the weights have not changed since.
    bad_steps: int = 0
    bad_log: list[str] = field(default_factory=list)
    last_good_step: int = 0
    rng: dict[str, Any] | None = None  # every RNG's state, as of the save (restore_rng_state)
    # Every rank's RNG states (rng is rank 0's), and how many processes wrote the checkpoint.
    rng_ranks: list[dict[str, Any]] | None = None
    world_size: int = 1
    # TRL's adaptive entropy control (loss.use_adaptive_entropy): the coefficient (None: not yet
    # adapted, loss.entropy_coef) and the last step's entropy (inf: none measured yet).
    entropy_coef: float | None = None
    last_entropy: float = math.inf
    # The warm-up (sft): its optimizer steps done, and whether it ended (GRPO runs after it).
    sft_step: int = 0
    sft_done: bool = False
    warmed: str | None = None  # its checkpoint sft-end (the warmed reference reads it on resume)
    # The learnable band (data.pass_rate_band): the indices of the training prompts it kept, None
    # before it ran (or without one).
    band: list[int] | None = None
    # trainer.micro_batch_tokens=auto's plan (fit.FitPlan.as_dict), made before step 1: a resume
    # reuses it rather than probing again.
    fit: dict[str, Any] | None = None
    # trainer.best_metric's progress (early.Progress.as_dict): the best value and step, the
    # evaluations since, where early stopping ended the run. None: no validation yet.
    early: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        state = cls(step=int(data["step"]), stream=dict(data["stream"]), rng=data["rng"])
        state.grad_scaler = dict(data.get("grad_scaler") or {})
        state.bad_steps = int(data.get("bad_steps", 0))
        state.bad_log = list(data.get("bad_log", []))
        state.last_good_step = int(data.get("last_good_step", state.step))
        state.rng_ranks = data.get("rng_ranks") or [state.rng]
        state.world_size = int(data.get("world_size", 1))
        state.entropy_coef = data.get("entropy_coef")
        state.last_entropy = float(data.get("last_entropy", math.inf))
        state.sft_step = int(data.get("sft_step", 0))
        state.sft_done = bool(data.get("sft_done", False))
        state.warmed = data.get("warmed")
        band = data.get("band")
        state.band = None if band is None else [int(i) for i in band]
        state.fit = data.get("fit")
        state.early = data.get("early")
        return state

    def rng_of(self, rank: int) -> dict[str, Any] | None:
        """The RNG states rank `rank` saved (rank 0's when the checkpoint had fewer ranks)."""
        ranks = self.rng_ranks or [self.rng]
        return ranks[rank] if rank < len(ranks) else ranks[0]


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


# ----------------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from: Python's, NumPy's, torch's CPU and CUDA generators. Plain
    containers and tensors only, so it loads with torch.load(weights_only=True)."""
    state: dict[str, Any] = {
        "python": list(_flatten_py_state(random.getstate())),
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
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
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"])
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- saving


def save_checkpoint(
    run_dir: Path,
    state: TrainerState,
    *,
    model,
    tokenizer,
    optimizer,
    scheduler,
    config_yaml: str,
    keep_last: int,
    rng_ranks: list[dict[str, Any]] | None = None,
    dist=None,
    state_dict: dict[str, Any] | None = None,
    name: str | None = None,
) -> Path:
    """Checkpoint `name` (default `step-<state.step>`; the warm-up's: sft-N, sft-end): the model,
    tokenizer, optimizer, scheduler, config and `state` with every RNG's current state (rng_ranks:
    every rank's, gathered; default this process's). A model sharded by FSDP2 is saved by every
    process together (`dist`: this process's distributed.Dist); otherwise only rank 0 calls this.
    `state_dict`: the weights to write instead of the model's own (bf16: the fp32 masters)."""
    from grpo_cli.distributed import Dist, is_sharded

    d, sharded = dist or Dist(), is_sharded(model)
    rng_ranks = rng_ranks or [rng_state()]
    root = checkpoints_dir(run_dir)
    final = root / (name or f"step-{state.step:06d}")
    pid = d.broadcast(os.getpid()) if sharded else os.getpid()
    tmp = root / f"{TMP_PREFIX}{final.name.removeprefix('step-')}-{pid}"  # .tmp-step-000050-<pid>
    try:
        if d.is_main:
            root.mkdir(parents=True, exist_ok=True)
            clean_partial(run_dir)
            tmp.mkdir()
        full = None
        if sharded:  # every process writes its shard, then rank 0 the whole model
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_state_dict,
            )

            d.barrier()  # the folder exists
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / SHARDED_DIR)
            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )  # on rank 0
            # Tied weights (the head sharing the embeddings) once, as save_pretrained writes them.
            own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
            full = {k: v for k, v in full.items() if k in own}
        if d.is_main:
            # save_embedding_layers=False: PEFT's "auto" would ask the hub about the base model on
            # every save (no embedding layer is adapted here).
            extra = {"save_embedding_layers": False} if is_adapted(model) else {}
            if sharded or state_dict is not None:
                extra["state_dict"] = full if sharded else state_dict  # (FSDP: gathered above)
            model.save_pretrained(tmp, safe_serialization=True, **extra)
            if state_dict is not None:  # config.json names the model's (bf16) dtype, not the file's
                _set_config_dtype(tmp / "config.json", "float32")
            tokenizer.save_pretrained(tmp)
            if not sharded:
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / "config.yaml").write_text(config_yaml)
            # Written last: a folder holding trainer_state.pt holds everything else.
            record = {
                **asdict(state),
                "format": FORMAT_VERSION,
                "rng": rng_ranks[0],
                "rng_ranks": rng_ranks,
                "world_size": len(rng_ranks),
            }
            torch.save(record, tmp / "trainer_state.pt")
            fsync_tree(tmp)
            if final.exists():  # re-saving a step: move the old one aside, never delete in place
                trash = root / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
                os.replace(final, trash)
                os.replace(tmp, final)
                fsync_dir(root)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
                fsync_dir(root)
    except Exception as exc:  # I/O errors surface as OSError, SafetensorError, RuntimeError...
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"could not write checkpoint {final}: {first_line(exc)}. {_disk_hint(root)}"
            "Free disk space or point hydra.run.dir at a disk with room (and resume with "
            "trainer.resume=auto); earlier checkpoints are intact."
        ) from exc
    except BaseException:  # interrupted mid-write: leave no partial folder
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if d.is_main and final.name != SFT_END:
        _rotate(root, keep_last, SFT_DIR if SFT_DIR.match(final.name) else STEP_DIR)
    return final


def save_best(
    run_dir: Path, *, model, tokenizer, config_yaml: str, record: dict[str, Any], state_dict=None
) -> Path:
    """checkpoints/best: the model (a LoRA model: its adapter), its tokenizer, config.yaml and
    best.json (`record`: the metric, its value, the step), no optimizer state; written whole under a
    temporary name, then renamed over the previous best. grpo-eval --checkpoint, grpo-chat and
    grpo-export read it as any checkpoint; a resume does not (it has no trainer state)."""
    root = checkpoints_dir(run_dir)
    final, tmp = root / BEST, root / f"{TMP_PREFIX}{BEST}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        extra = {"save_embedding_layers": False} if is_adapted(model) else {}
        if state_dict is not None:
            extra["state_dict"] = state_dict
        model.save_pretrained(tmp, safe_serialization=True, **extra)
        if state_dict is not None:  # (the fp32 masters of a bf16 policy)
            _set_config_dtype(tmp / "config.json", "float32")
        tokenizer.save_pretrained(tmp)
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "best.json").write_text(json.dumps(record, indent=1) + "\n")
        fsync_tree(tmp)
        trash = root / f"{TRASH_PREFIX}{BEST}-{os.getpid()}"
        if final.exists():
            os.replace(final, trash)
        os.replace(tmp, final)
        fsync_dir(root)
        shutil.rmtree(trash, ignore_errors=True)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"could not write checkpoint {final}: {first_line(exc)}. {_disk_hint(root)}"
            "Free disk space or point hydra.run.dir at a disk with room; the other checkpoints are intact."
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_sharded(path: Path, model, optimizer) -> None:
    """FSDP: a checkpoint's sharded model and optimizer state into this run's (each process
    reads what its shards need, whatever the number of processes that wrote it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    saved = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(saved, checkpoint_id=path / SHARDED_DIR)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])


def _set_config_dtype(config_json: Path, dtype: str) -> None:
    """Record `dtype` as the weights' dtype in a saved config.json (from_pretrained(dtype="auto")
    reads it)."""
    config = json.loads(config_json.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _disk_hint(root: Path) -> str:
    for path in (root, *root.parents):
        if path.exists():
            try:
                free = shutil.disk_usage(path).free
            except OSError:
                return ""
            return f"{free / 2**30:.2f} GiB free on that disk. "
    return ""


def _rotate(root: Path, keep_last: int, kind: re.Pattern) -> None:
    """Keep the last `keep_last` checkpoints of one kind (step-N, or the warm-up's sft-N)."""
    steps = [p for p in list_checkpoints(root.parent) if kind.match(p.name)]
    for old in steps[:-keep_last] if keep_last > 0 else []:
        trash = root / f"{TRASH_PREFIX}{old.name}-{os.getpid()}"
        try:
            os.replace(old, trash)  # atomic: a half-deleted folder is never named step-N
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)


def clean_partial(run_dir: Path) -> None:
    """Remove what a killed run left half-written: temporary and half-deleted folders."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- finding


def is_sharded_checkpoint(path: Path) -> bool:
    return (path / SHARDED_DIR).is_dir()


def missing_files(path: Path) -> list[str]:
    required = [n for n in REQUIRED_FILES if n != "optimizer.pt" or not is_sharded_checkpoint(path)]
    missing = [name for name in required if not (path / name).is_file()]
    if (path / ADAPTER_FILES[0]).is_file():  # a LoRA checkpoint
        return missing + [name for name in ADAPTER_FILES[1:] if not (path / name).is_file()]
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append(WEIGHT_FILES[0])
    return missing


def _position(name: str) -> tuple[int, int] | None:
    """Where a checkpoint folder lies in a run: the warm-up's sft-N, then sft-end, then GRPO's
    step-N; None for a folder that is none of them."""
    if m := STEP_DIR.match(name):
        return (2, int(m.group(1)))
    if m := SFT_DIR.match(name):
        return (0, int(m.group(1)))
    return (1, 0) if name == SFT_END else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first: the warm-up's (sft-N, sft-end), then GRPO's
    step-N (temporary, half-deleted or incomplete folders are never listed)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _position(p.name) and not missing_files(p)]
    return sorted(found, key=lambda p: _position(p.name))


def find_resume_checkpoint(resume: str, run_dir: Path) -> Path:
    """`auto`: the latest checkpoint in this run's folder; else a checkpoint or run folder."""
    if resume == "auto":
        clean_partial(run_dir)
        found = list_checkpoints(run_dir)
        if not found:
            raise UserError(
                f"trainer.resume=auto found no checkpoint in {checkpoints_dir(run_dir)}. "
                "Resume by running with hydra.run.dir=<the run folder> trainer.resume=auto, "
                "or give trainer.resume=<checkpoint folder>."
            )
        return found[-1]
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise UserError(
            f"trainer.resume={resume!r} does not exist (looked in {path.absolute()}); give a "
            "checkpoint folder like outputs/.../checkpoints/step-000050, its run folder, or auto."
        )
    if not (path / "trainer_state.pt").is_file():
        found = list_checkpoints(path)
        if found:
            return found[-1]
        raise UserError(
            f"trainer.resume={resume!r} is not a grpo-cli checkpoint (no trainer_state.pt); "
            "give a folder like outputs/.../checkpoints/step-000050 or its run folder."
        )
    missing = missing_files(path)
    if missing:
        raise UserError(
            f"trainer.resume={resume!r} is an incomplete checkpoint (missing "
            f"{', '.join(missing)}); resume from an earlier one in {path.parent}."
        )
    return path


# ----------------------------------------------------------------------------- loading


def load_training_state(path: Path) -> tuple[TrainerState, dict, dict]:
    """(trainer state, optimizer state, scheduler state), loaded with weights_only=True: a
    checkpoint can hold tensors and plain containers, never arbitrary pickled objects."""
    try:
        trainer_state = torch.load(path / "trainer_state.pt", weights_only=True)
        optimizer_state = (
            None if is_sharded_checkpoint(path) else torch.load(path / "optimizer.pt", weights_only=True)
        )  # FSDP: in sharded/, loaded with the model (load_sharded)
        scheduler_state = torch.load(path / "scheduler.pt", weights_only=True)
    except Exception as exc:
        import pickle

        why = (
            "torch.load(weights_only=True) refused it: it is not a PyTorch file, or it holds pickled "
            "objects besides tensors and plain values"
            if isinstance(exc, pickle.UnpicklingError)
            else first_line(exc, 160)
        )
        raise UserError(
            f"checkpoint {path} cannot be loaded ({why}); it is corrupt or was not written by "
            "grpo-train. Resume from an earlier checkpoint."
        ) from exc
    if isinstance(trainer_state, dict) and int(trainer_state.get("format", 1)) > FORMAT_VERSION:
        raise UserError(
            f"checkpoint {path} was written by a newer grpo-cli (checkpoint format "
            f"{trainer_state['format']}, this one reads {FORMAT_VERSION}); upgrade grpo-cli to resume it."
        )
    required = ("step", "stream", "rng")
    if not isinstance(trainer_state, dict) or any(k not in trainer_state for k in required):
        raise UserError(
            f"checkpoint {path}: trainer_state.pt lacks the step, data position or RNG state; "
            "it was not written by this version of grpo-train. Start a new run, or resume "
            "from a checkpoint this version wrote."
        )
    return TrainerState.from_dict(trainer_state), optimizer_state, scheduler_state
