"""The optimizer and its learning-rate schedule, and the optimizer step object the loop drives."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.errors import UserError, first_line

# adamw: torch's fused AdamW (fp32 state). adamw_8bit: bitsandbytes' AdamW8bit (8-bit blockwise
# state; its CPU backend steps CPU tensors since bitsandbytes 0.50). adamw_bf16_sr: torchao's AdamW
# with bf16 stochastic rounding, stepping the bf16 weights of trainer.precision=bf16 directly (no
# fp32 master copy). The two libraries are the `memory-levers` extra (docs/precision.md).
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_bf16_sr")
LR_SCHEDULERS = ("constant", "linear", "cosine")
EXTRA = "memory-levers"
# optimizer.name -> (the library it is built from, the oldest version tested, what it needs it for).
LIBRARIES = {
    "adamw_8bit": ("bitsandbytes", "0.50.2", "8-bit AdamW state, on the CPU and on CUDA"),
    "adamw_bf16_sr": ("torchao", "0.18.0", "AdamW with bf16 stochastic rounding"),
}
# bitsandbytes keeps the state of a tensor smaller than this (its min_8bit_size) in fp32.
MIN_8BIT_SIZE = 4096


def check_optimizer(opt, cfg=None) -> list[str]:
    """The optimizer group's values (config validation; OPTIMIZERS and LR_SCHEDULERS are checked
    with every group's choices). `cfg`: the whole config, for the optimizers that depend on the
    trainer's precision, processes and adapter, and whose library must be installed: checked here,
    before any model loads."""
    problems = []
    if not opt.learning_rate > 0:
        problems.append(f"optimizer.learning_rate={opt.learning_rate} must be > 0, e.g. 1e-6.")
    if not opt.max_grad_norm > 0:
        problems.append(f"optimizer.max_grad_norm={opt.max_grad_norm} must be > 0, e.g. 1.0.")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= opt[key] < 1:
            problems.append(f"optimizer.{key}={opt[key]} must be in [0, 1).")
    if opt.name in LIBRARIES:
        problems += _library_problems(opt.name)
    if cfg is not None and opt.name in LIBRARIES:
        problems += _setting_problems(opt.name, cfg)
    return problems


def _version(package: str) -> str | None:
    """The installed version of `package` (None: not installed), without importing it."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _older(version: str, than: str) -> bool:
    def key(v: str) -> tuple[int, ...]:
        parts = []
        for part in v.split("+")[0].split(".")[:3]:
            digits = "".join(c for c in part if c.isdigit()) or "0"
            parts.append(int(digits))
        return tuple(parts)

    return key(version) < key(than)


def _library_problems(name: str) -> list[str]:
    """optimizer.name=`name`'s library: installed, and at least the version tested."""
    package, tested, what = LIBRARIES[name]
    version = _version(package)
    install = (
        f"grpo-cli's `{EXTRA}` extra (pip install -e '.[{EXTRA}]' in grpo-cli's folder, or "
        f"GRPO_EXTRAS={EXTRA} bash scripts/run.sh ...)"
    )
    if version is None:
        return [
            f"optimizer.name={name} ({what}) is built from {package}, which is not installed in this "
            f"environment. Install it with {install} (or pip install '{package}>={tested}'), or choose "
            "optimizer.name=adamw (torch's AdamW, nothing to install)."
        ]
    if _older(version, tested):
        return [
            f"optimizer.name={name} ({what}) needs {package} >= {tested} (the version tested; "
            + (
                "older releases have no CPU kernel for the 8-bit update"
                if package == "bitsandbytes"
                else "older releases may not import with this torch"
            )
            + f"), and {package} {version} is installed. Upgrade it with pip install -U '{package}>={tested}' "
            f"(or install {install}), or choose optimizer.name=adamw."
        ]
    return []


def _setting_problems(name: str, cfg) -> list[str]:
    """Where optimizer.name=`name` cannot act: bf16 stochastic rounding steps bf16 weights (it needs
    trainer.precision=bf16 and full fine-tuning without FSDP2); neither library steps FSDP2's
    sharded parameters here."""
    from grpo_cli.distributed import planned_world_size

    tr = cfg.trainer
    problems = []
    sharded = tr.distributed == "fsdp" and planned_world_size(tr) > 1
    if name == "adamw_bf16_sr":
        if tr.precision != "bf16":
            problems.append(
                f"optimizer.name=adamw_bf16_sr steps bf16 weights with stochastic rounding instead of fp32 "
                f"master copies, and trainer.precision={tr.precision} "
                + (
                    "keeps the weights in fp32 (there is nothing to round: the update is exact already)"
                    if tr.precision in ("fp32", "bf16-autocast", "fp16")
                    else "may resolve to fp32 (auto picks fp32 on CPUs without bf16 units)"
                )
                + ". Set trainer.precision=bf16 with it, or choose optimizer.name=adamw "
                "(under bf16: fp32 master copies, which keep every update) or adamw_8bit (smaller AdamW state)."
            )
        if cfg.adapter.name != "none":
            problems.append(
                f"optimizer.name=adamw_bf16_sr rounds bf16 weights, and adapter.name={cfg.adapter.name} "
                "trains fp32 adapters (the bf16 base is frozen, there is no master copy to drop): choose "
                "optimizer.name=adamw, or adapter.name=none to train every weight in bf16."
            )
        if sharded:
            problems.append(
                "optimizer.name=adamw_bf16_sr with trainer.distributed=fsdp: FSDP2 keeps fp32 shards and "
                "gathers bf16 copies (its mixed precision), so there are no bf16 weights to round; use "
                "trainer.distributed=ddp, or optimizer.name=adamw."
            )
    elif name == "adamw_8bit" and sharded:
        problems.append(
            "optimizer.name=adamw_8bit with trainer.distributed=fsdp is not offered: bitsandbytes steps "
            "whole tensors, not FSDP2's sharded parameters (DTensors), and it was not tested here; use "
            "trainer.distributed=ddp (each process holds its own 8-bit state), or optimizer.name=adamw."
        )
    return problems


def build_optimizer(params, cfg, *, total_updates: int):
    """The optimizer optimizer.name names over `params` (the trainable parameters) and its schedule
    (transformers' schedulers, stepped once per applied update), from the optimizer section `cfg`
    (config.OptimizerConfig, read by attribute)."""
    from transformers import get_scheduler

    params = [p for p in params if p.requires_grad]
    kw = dict(
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
    )
    name = getattr(cfg, "name", "adamw")
    if name == "adamw_8bit":
        optimizer = _adamw_8bit(params, kw)
    elif name == "adamw_bf16_sr":
        optimizer = _adamw_bf16_sr(params, kw)
    else:
        optimizer = _adamw(params, kw)
    scheduler = get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_updates
    )
    return optimizer, scheduler


def _adamw(params, kw):
    """torch's AdamW, fused where every parameter allows it."""
    import torch

    # The fused kernel (one pass over each tensor) is the same update as the default multi-tensor
    # one, about 5x faster on a CPU (0.13 s vs 0.68 s a step for 135M parameters here).
    fused = all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params
    )
    return torch.optim.AdamW(params, **kw, fused=fused or None)


def _import(name: str):
    """optimizer.name=`name`'s library, imported (validation checked that it is installed; an
    import that fails anyway, e.g. against another torch, is said in one paragraph)."""
    import importlib
    import logging

    package, tested, what = LIBRARIES[name]
    # (torchao logs a warning for each of its CUDA extensions that a CPU build of torch cannot load;
    # the optimizers need none of them.)
    log = logging.getLogger(package)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - any import failure: said with the fix
        raise UserError(
            f"optimizer.name={name} ({what}) needs {package}, and importing it failed: {first_line(exc, 200)}. "
            f"Install a release that matches this torch (pip install -U '{package}>={tested}', or "
            f"pip install -e '.[{EXTRA}]' in grpo-cli's folder), or choose optimizer.name=adamw."
        ) from exc
    finally:
        log.setLevel(level)


def _adamw_8bit(params, kw):
    """bitsandbytes' AdamW8bit: both moments in 8 bits (blockwise dynamic quantisation, blocks of
    256, an fp32 scale each), the update computed in fp32; a tensor of fewer than MIN_8BIT_SIZE
    elements (norms, biases, small projections) keeps fp32 moments. Eager, the same library and
    state on the CPU (its CPU backend, bitsandbytes >= 0.50) and on CUDA. Not paged."""
    bnb = _import("adamw_8bit")
    return bnb.optim.AdamW8bit(params, **kw, min_8bit_size=MIN_8BIT_SIZE)


def _adamw_bf16_sr(params, kw):
    """torchao's AdamW (torchao.optim._AdamW) with bf16_stochastic_round: each bf16 weight is
    updated in fp32 and rounded back to bf16 stochastically (up with the probability of the
    dropped fraction), so an update smaller than a bf16 step lands on average instead of rounding
    away; the moments are stored in the weights' dtype (bf16). Each parameter shape is compiled
    once by torch.compile on its first step (a C++ compiler on the CPU)."""
    _import("adamw_bf16_sr")
    from torchao.optim import _AdamW

    return _AdamW(params, **kw, bf16_stochastic_round=True)


def steps_bf16_weights(optimizer) -> bool:
    """The optimizer steps the model's bf16 weights itself (adamw_bf16_sr): no fp32 master copy."""
    return bool(getattr(optimizer, "bf16_stochastic_round", False))


def _check_bf16(optimizer) -> None:
    """adamw_bf16_sr's parameters are bf16 (validation requires trainer.precision=bf16 and full
    fine-tuning; a weight in another dtype would be stepped without rounding, as plain AdamW)."""
    import torch

    dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"]}
    if dtypes - {torch.bfloat16}:
        raise UserError(
            "optimizer.name=adamw_bf16_sr rounds bf16 weights, and this run's trained weights are "
            f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}: set trainer.precision=bf16 "
            "(full fine-tuning, without FSDP2), or choose optimizer.name=adamw."
        )


def _onto_the_model(optimizer, masters) -> None:
    """An optimizer built over `masters`' fp32 copies (build.optimizer_step hands it those under
    trainer.precision=bf16), pointed at the model's bf16 weights instead, before its first step
    (it holds no state yet): the copies are then referenced by nothing and freed."""
    assert not optimizer.state, "the optimizer has stepped already"
    model = {id(master): p for (_, p), master in zip(masters.named, masters.params)}
    for group in optimizer.param_groups:
        group["params"] = [model.get(id(q), q) for q in group["params"]]


@dataclass
class StepResult:
    """What OptimizerStep.step did with one update's gradient."""

    applied: bool  # the weights moved
    loss: float  # the update's loss, summed over the processes
    grad_norm: float  # before clipping (ref 000.7)
    finite: bool  # loss and gradient both finite
    nonfinite_where: str  # the parameters whose gradient was not finite ("" when none, or the loss)
    scale: float | None  # fp16: the grad scaler's scale after this update (None: no scaler)


class OptimizerStep:
    """The optimizer's side of an update, with one small interface (backward per micro-batch,
    step per update): bf16 weights with fp32 masters, fp16's grad scaler, clipping, and the skips.

    - backward(loss): one micro-batch's backward (scaled by the grad scaler; times the process
      count, since DDP averages); bf16 masters take the gradient in fp32 after each one, so the
      micro-batches are summed in fp32.
    - step(loss, has_signal): several processes' fp32 master gradients summed over the ranks
      (reduces_grads: then DDP must not reduce the bf16 ones itself), unscale, clip (the pre-clip
      norm is logged, ref 000.7), and either the update (optimizer, masters -> model, schedule)
      or a skip: a non-finite loss or gradient leaves the weights as they were, and so does an
      update without learning signal (ref 002): its gradient is 0, but AdamW's momentum and
      weight decay would still move the weights.

    optimizer.name=adamw_bf16_sr: build.optimizer_step hands over an optimizer built over the
    masters, as for any bf16 run; here it is pointed at the model's bf16 weights before its first
    step and the masters are dropped (their fp32 tensors freed), so the bf16 gradients are summed
    in bf16 over the micro-batches (and reduced by DDP), and the optimizer rounds each update into
    the weights stochastically.
    """

    def __init__(self, optimizer, scheduler, *, policy, masters, grad_scaler, max_grad_norm: float, dist):
        if masters is not None and steps_bf16_weights(optimizer):
            # adamw_bf16_sr: the optimizer steps the bf16 weights themselves; the fp32 copies go.
            _onto_the_model(optimizer, masters)
            masters = None
        if steps_bf16_weights(optimizer):
            _check_bf16(optimizer)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.policy, self.masters, self.scaler, self.dist = policy, masters, grad_scaler, dist
        self.max_grad_norm = max_grad_norm
        # What the optimizer updates, clipping and grad_norm cover: every trainable weight (the
        # adapters' with LoRA); under trainer.precision=bf16 their fp32 master copies (with
        # adamw_bf16_sr the bf16 weights themselves).
        self.params = masters.params if masters else [p for p in policy.parameters() if p.requires_grad]
        # DDP with bf16 masters: the ranks' fp32 sums are reduced here, not DDP's bf16 ones.
        self.reduces_grads = masters is not None and dist.enabled

    def backward(self, loss) -> None:
        """One micro-batch's backward; the caller holds DDP's gradient_sync context."""
        scaled = loss * self.dist.world_size if self.dist.enabled else loss
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if self.masters:
            self.masters.take_grads()

    def step(self, loss: float, has_signal: bool) -> StepResult:
        """The update of the gradient accumulated since the last step, or its skip."""
        import math

        import torch

        from grpo_cli.guards import nonfinite_grads

        loss = self.dist.sum([loss])[0]  # every rank decides alike
        if self.reduces_grads:  # (DDP: the model's gradients were never reduced)
            grads = [p.grad for p in self.params if p.grad is not None]
            self.dist.sum_tensors_(grads)
            for g in grads:
                g.div_(self.dist.world_size)  # DDP's mean of the W-scaled losses: their sum
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        applied = finite and has_signal
        where = "" if finite or not math.isfinite(loss) else nonfinite_grads(self.masters or self.policy)
        if applied:
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.masters:  # the updated fp32 weights, rounded, into the bf16 model
                self.masters.put_weights()
            self.scheduler.step()
        elif self.scaler:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.scaler.get_scale() if self.scaler else None
        return StepResult(applied, loss, grad_norm, finite, where, scale)

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])  # (torchao keeps it as a tensor)

    def scaler_state(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}
