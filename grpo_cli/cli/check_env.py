"""`grpo-check-env`: is this machine and install fit to train? Paste the block into bug reports."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Any

REQUIRED = ("torch", "transformers", "datasets", "hydra", "omegaconf", "rich", "safetensors", "accelerate")
OPTIONAL = ("gguf", "math_verify", "pytest")
DIST_NAMES = {"hydra": "hydra-core", "math_verify": "math-verify"}


def _package_version(module: str) -> tuple[str | None, str | None]:
    """(version, error): error is set when the package is missing or fails to import."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # a broken install raises anything, not only ImportError
        return None, f"{type(exc).__name__}: {exc}"
    version = getattr(mod, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(DIST_NAMES.get(module, module))
        except PackageNotFoundError:
            version = "unknown"
    return str(version), None


def _memory_gib() -> float | None:
    try:
        import psutil

        return psutil.virtual_memory().total / 2**30
    except Exception:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError, AttributeError):
            return None


def recommend_precision(cuda: bool, bf16: bool) -> tuple[str, str]:
    """The precision grpo-train's `precision=auto` picks, and why (ref 004 self-check)."""
    if cuda and bf16:
        return "bf16", "the GPU supports bf16: half the memory of fp32 and no loss scaling needed"
    if cuda:
        return "fp16", "the GPU lacks bf16; fp16 needs a grad scaler (grpo-cli uses one)"
    return "fp32", "no CUDA GPU: the CPU trains in fp32 (bf16 on CPU is opt-in: precision=bf16)"


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "ram_gib": _memory_gib(),
        "packages": {},
        "problems": [],
    }
    for module in REQUIRED + OPTIONAL:
        version, error = _package_version(module)
        name = DIST_NAMES.get(module, module)
        info["packages"][name] = version
        if error and module in REQUIRED:
            info["problems"].append(
                f"required package {name} cannot be imported ({error}); reinstall it: pip install -e '.[dev]'"
            )
    cuda = bf16 = False
    gpu_name = vram = None
    if info["packages"].get("torch"):
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            gpu_name = torch.cuda.get_device_name(0)
            vram = torch.cuda.get_device_properties(0).total_memory / 2**30
            bf16 = torch.cuda.is_bf16_supported()
        info["torch_cuda_version"] = torch.version.cuda
        info["torch_threads"] = torch.get_num_threads()
    info.update(cuda_available=cuda, gpu_name=gpu_name, vram_gib=vram, bf16_supported=bf16)
    precision, why = recommend_precision(cuda, bf16)
    info["recommended_precision"] = precision
    info["recommended_precision_reason"] = why
    return info


def format_report(info: dict[str, Any]) -> str:
    def gib(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.1f} GiB"

    lines = [
        "grpo-cli environment report",
        f"  python           {info['python']} ({info['platform']})",
        f"  cpu cores        {info['cpu_cores']}",
        f"  ram              {gib(info['ram_gib'])}",
        f"  cuda available   {info['cuda_available']}",
        f"  gpu              {info['gpu_name'] or '-'}",
        f"  vram             {gib(info['vram_gib']) if info['vram_gib'] else '-'}",
        f"  bf16 supported   {info['bf16_supported']}",
        f"  precision        {info['recommended_precision']} ({info['recommended_precision_reason']})",
        "  packages:",
    ]
    for name, version in info["packages"].items():
        lines.append(f"    {name:<16} {version or 'MISSING'}")
    if info["problems"]:
        lines.append("problems:")
        lines += [f"  - {p}" for p in info["problems"]]
    else:
        lines.append("status: OK")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo-check-env", description="Check that this machine and install can run grpo-train."
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_report(info))
    return 1 if info["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
