"""`grpo-export`: a checkpoint as a plain model folder that AutoModelForCausalLM.from_pretrained
loads and an inference server (vLLM, TGI, llama.cpp's converter) serves: the weights (a LoRA
checkpoint's adapters merged into its base model: W + B A * alpha / r) and the tokenizer, without
the optimizer and trainer state.

    grpo-export outputs/.../checkpoints/step-000032 --output smollm2-grpo
    grpo-export outputs/.../checkpoints/step-000032 --output smollm2-grpo --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from grpo_cli.errors import UserError, first_line, report_and_exit

DTYPES = ("fp32", "bf16", "fp16")


def export(checkpoint: str, output: str, *, dtype: str = "fp32", log=print) -> Path:
    """Write the merged model and tokenizer of `checkpoint` to the new folder `output` (written to
    a temporary folder and renamed into place: never half-written)."""
    import torch

    from grpo_cli.adapters import is_adapted, merged
    from grpo_cli.build import build_tokenizer, load_policy
    from grpo_cli.cli.common import typed_config
    from grpo_cli.precision import resolve_precision

    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"--output {output!r} already exists and is not an empty folder; give a new folder name "
            "(grpo-export never overwrites)."
        )
    cfg = typed_config([], checkpoint=checkpoint)
    if cfg.adapter.quantization != "none":
        raise UserError(
            f"checkpoint {checkpoint} trained adapters on a 4-bit base (QLoRA); merging them into 4-bit "
            "weights would lose precision. Export from the full-precision base instead: rerun grpo-export "
            "with the same checkpoint after setting adapter.quantization=none in its config.yaml."
        )
    device = torch.device("cpu")  # merging is cheap; the CPU holds any model that trained on this machine
    source, tokenizer = build_tokenizer(cfg, log)
    model = load_policy(cfg, source, device, resolve_precision("fp32", device), trainable=False)
    adapted = is_adapted(model)
    model = merged(model)
    model = model.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"could not write {out}: {first_line(exc)}; free disk space or pick another folder."
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    what = "LoRA adapters merged into the base model" if adapted else "the full model"
    log(f"wrote {out} ({what}, {dtype}); load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a grpo-cli checkpoint folder (outputs/.../checkpoints/step-N)")
    parser.add_argument("--output", required=True, help="the new folder to write the model to")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights' dtype (default fp32)")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.output, dtype=args.dtype)
    except UserError as exc:
        report_and_exit("grpo-export", [str(exc)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
