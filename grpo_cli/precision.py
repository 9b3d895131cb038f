"""Device and precision: which device a run uses, and how its forward passes are computed.

Torch is imported inside the functions, so the config's validation (which lists PRECISIONS) does
not pay for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_cli.errors import UserError

if TYPE_CHECKING:
    import torch

PRECISIONS = ("auto", "fp32", "bf16", "bf16-autocast", "fp16")
# trainer.frozen_precision: the frozen models' (the KL reference's, a teacher's) weights dtype.
FROZEN_PRECISIONS = ("same", "bf16")


@dataclass(frozen=True)
class Precision:
    """How a run computes (trainer.precision):

    fp32           fp32 weights, fp32 compute.
    bf16           bf16 weights with fp32 master weights: the sampler and the training
                   forward/backward run on bf16 weights (half the bytes to stream, the bf16 units
                   of the GPU or CPU); the optimizer keeps an fp32 copy of every trained weight
                   and its moments (MasterWeights) and rounds it into the model after each update.
                   With LoRA the frozen base is bf16 and the adapters stay fp32 (no copy needed).
    bf16-autocast  fp32 weights, forward passes under bf16 autocast (every weight is cast at each
                   use: slower than bf16 on the CPU, the same memory as fp32 for the weights).
    fp16           fp32 weights, fp16 autocast and a grad scaler (GPUs without bf16).
    """

    name: str  # fp32 | bf16 | bf16-autocast | fp16
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_grad_scaler: bool
    weights_dtype: torch.dtype | None = None  # bf16: the model's weights are stored in it

    @property
    def frozen_dtype(self) -> torch.dtype:
        """The dtype a frozen helper model (a reward model) is stored and run in: the half
        precision the run computes in, else fp32."""
        import torch

        return self.weights_dtype or self.autocast_dtype or torch.float32


def frozen_weights_dtype(precision: Precision, frozen_precision: str = "same") -> torch.dtype | None:
    """The dtype a frozen model scored by the trainer (the KL reference, a teacher: frozen.py) is
    stored in; None: as loaded (fp32). `same` follows the policy's weights (bf16 under
    trainer.precision=bf16); `bf16` stores it in bf16 whatever the policy trains in, so that its
    forward runs in bf16 (half its weights' memory; its log-probs are still returned in fp32)."""
    import torch

    if frozen_precision == "bf16":
        return torch.bfloat16
    return precision.weights_dtype


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"trainer.device={name!r} but no CUDA GPU is visible to PyTorch "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Use trainer.device=cpu, "
            "or run grpo-check-env to see why the GPU is missing."
        )
    return device


def pick_precision(cuda: bool, bf16: bool) -> tuple[str, str]:
    """What trainer.precision=auto picks, and why (grpo-check-env prints both): `bf16` is whether
    the GPU supports bf16 (with `cuda`), or whether the CPU has bf16 units (without)."""
    if cuda and bf16:
        return "bf16", "the GPU computes in bf16 natively; fp32 master weights keep small updates exact"
    if cuda:
        return "fp16", "the GPU lacks bf16; fp16 needs a grad scaler (grpo-cli uses one)"
    if bf16:
        return "bf16", (
            "no CUDA GPU; this CPU has bf16 units (AVX512-BF16/AMX): bf16 weights with fp32 masters "
            "step 1.4-1.6x faster than fp32 and learned the default recipe as well (README: precision)"
        )
    return "fp32", "no CUDA GPU and no CPU bf16 units: fp32 (bf16 would only be emulated here)"


def auto_precision(device: torch.device) -> str:
    """trainer.precision=auto on `device` (pick_precision)."""
    import torch

    cuda = device.type == "cuda"
    return pick_precision(cuda, torch.cuda.is_bf16_supported() if cuda else cpu_has_bf16())[0]


def cpu_has_bf16() -> bool:
    """The CPU has bf16 units (AVX512-BF16 or AMX) that oneDNN uses for bf16 matrix products."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


def emulation_note(precision: Precision, device: torch.device) -> str | None:
    """A note for a bf16/bf16-autocast run on a CPU without bf16 units, where PyTorch emulates bf16
    matrix products: on an AVX2-only EPYC a SmolLM2-135M backward's [n, k] @ [k, m] products took
    50-100x their fp32 time, and a 16-completion step 50.5 s against fp32's 8.2 s. None elsewhere."""
    half = precision.weights_dtype or precision.autocast_dtype
    if device.type != "cpu" or half is None or cpu_has_bf16():
        return None
    return (
        f"note: trainer.precision={precision.name} on a CPU without bf16 units (no AVX512-BF16 or AMX): "
        "PyTorch emulates bf16 matrix products here, and a training step takes several times (up to "
        "tens of times) fp32's time. trainer.precision=auto (fp32 on this CPU) trains faster; keep "
        "bf16 only to reproduce a bf16 run."
    )


def resolve_precision(name: str, device: torch.device, *, adapted: bool = False) -> Precision:
    """The Precision for trainer.precision=`name` on `device` (`auto`: see auto_precision).
    Sampling and training use the same setting, so the sampler's log-probs and the trainer's
    agree (the step-0 check verifies it). `adapted`: LoRA, whose frozen base is stored in bf16
    and whose fp32 adapters run under bf16 autocast (no master copy needed)."""
    import torch

    cuda = device.type == "cuda"
    bf16_ok = torch.cuda.is_bf16_supported() if cuda else device.type == "cpu"
    if name == "auto":
        name = auto_precision(device)
    if name == "fp32":
        return Precision("fp32", None, False)
    if name in ("bf16", "bf16-autocast"):
        if not bf16_ok:
            raise UserError(
                f"trainer.precision={name} but {torch.cuda.get_device_name(device)} has no bf16 "
                "support; use trainer.precision=fp16 (with a grad scaler) or fp32."
            )
        if name == "bf16-autocast" or adapted:
            return Precision(name, torch.bfloat16, False)
        return Precision("bf16", None, False, weights_dtype=torch.bfloat16)
    if name == "fp16":
        if not cuda:
            raise UserError(
                "trainer.precision=fp16 is not supported on the CPU (no fp16 autocast kernels); "
                "use trainer.precision=fp32, or bf16 on a CPU with AMX/AVX512-bf16."
            )
        return Precision("fp16", torch.float16, True)
    raise UserError(f"trainer.precision={name!r} is not one of {', '.join(PRECISIONS)}.")


def autocast(device: torch.device, precision: Precision):
    import torch

    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)


def to_weights_dtype(model, dtype: torch.dtype) -> None:
    """Store `model`'s floating-point parameters in `dtype`, in place. Buffers stay as they are:
    rotary embeddings' inv_freq rounded to bf16 would shift every position's angle."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 master weights for a model whose weights are stored in bf16 (trainer.precision=bf16).

    Why: bf16 keeps 8 bits of mantissa, so a weight of 0.05 moves in steps of 2.4e-4 and an
    update of lr 1e-6 would round to nothing. The optimizer therefore steps fp32 copies (with
    fp32 moments) that accumulate every update, and the model gets them rounded to bf16:

        backward on the bf16 model -> take_grads (bf16 grads -> fp32 .grad of the copies,
        after each micro-batch with one process, so they are summed in fp32)
        -> clip, optimizer.step on the copies -> put_weights (copies -> model, rounded)

    The copies start as the model's own fp32 tensors (loaded in fp32; no second fp32 copy is
    made), then the model is converted to bf16. Tied weights are one parameter, so one copy.
    """

    def __init__(self, model, dtype: torch.dtype):
        import torch

        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [torch.nn.Parameter(p.detach()) for _, p in self.named]  # the fp32 tensors
        to_weights_dtype(model, dtype)

    def take_grads(self) -> None:
        """The model's (bf16) gradients added into the copies' .grad in fp32; the model's are freed.
        Called after each micro-batch's backward, the micro-batches are summed in fp32 (one
        process); under DDP once before clipping (its reduce needs the sum in the model's .grad)."""
        for (_, p), master in zip(self.named, self.params):
            if p.grad is None:
                continue
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None

    def put_weights(self) -> None:
        """The copies, rounded to the model's dtype, into the model (after each update)."""
        import torch

        with torch.no_grad():
            for (_, p), master in zip(self.named, self.params):
                p.copy_(master)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The copies under the model's parameter names (guards.nonfinite_grads reads them)."""
        return [(name, master) for (name, _), master in zip(self.named, self.params)]

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        """`model`'s state dict with the fp32 copies in place of the bf16 weights: what a
        checkpoint stores, so that a resumed run continues from the exact fp32 values. Tied
        weights appear once, under the name named_parameters gives them (as save_pretrained
        writes them)."""
        own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        state = {k: v for k, v in model.state_dict().items() if k in own}
        state.update((name, master.detach()) for name, master in self.named_parameters())
        return state
