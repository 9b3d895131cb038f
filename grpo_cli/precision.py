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

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_grad_scaler: bool


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


def resolve_precision(name: str, device: torch.device) -> Precision:
    """Master weights stay fp32; bf16/fp16 run the forward passes under autocast.

    `auto`: bf16 on a GPU that supports it, fp16 with a grad scaler on one that does not, fp32
    on the CPU (ref 004 self-check). Sampling and training use the same setting, so the
    sampler's log-probs and the trainer's agree (the step-0 check verifies it).
    """
    import torch

    cuda = device.type == "cuda"
    bf16_ok = torch.cuda.is_bf16_supported() if cuda else device.type == "cpu"
    if name == "auto":
        name = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "fp32"
    if name == "fp32":
        return Precision("fp32", None, False)
    if name == "bf16":
        if not bf16_ok:
            raise UserError(
                f"trainer.precision=bf16 but {torch.cuda.get_device_name(device)} has no bf16 "
                "support; use trainer.precision=fp16 (with a grad scaler) or fp32."
            )
        return Precision("bf16", torch.bfloat16, False)
    if name == "fp16":
        if not cuda:
            raise UserError(
                "trainer.precision=fp16 is not supported on the CPU (no fp16 autocast kernels); "
                "use trainer.precision=fp32, or bf16 on a CPU with AMX/AVX512-bf16."
            )
        return Precision("fp16", torch.float16, True)
    raise UserError(f"trainer.precision={name!r} is not one of auto, fp32, bf16, fp16.")


def autocast(device: torch.device, precision: Precision):
    import torch

    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)
