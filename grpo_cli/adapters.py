"""LoRA adapters through PEFT: add them to a loaded model, load saved ones, the reference model
as the same model with its adapters disabled, and a merged full model for export.

A PEFT model is the transformers model with LoRA layers injected in place (each adapted
nn.Linear becomes a lora.Linear holding the frozen original as `base_layer` and the trainable
`lora_A`/`lora_B`); `PeftModel` wraps it for saving, loading and switching adapters. Forward passes
run the wrapped transformers model directly (logprobs.forward_model), so every path of the
trainer (the shared-prompt forward, the sampler's KV cache, the CPU decode's W @ x^T layers, which
reach the plain nn.Linear layers inside the LoRA layers) sees the same modules as without adapters.

peft is imported inside the functions: the config's validation lists the choices below and runs
`check_adapter` without importing torch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line

ADAPTERS = ("none", "lora")
# Both start with B = 0, so the adapted model starts as the base model exactly (and the first
# step's KL is 0). PEFT's other initialisations (PiSSA, OLoRA, CorDA) rewrite the base weights: the
# adapters-disabled model would then not be the reference, so they are not offered.
LORA_INITS = ("default", "gaussian")
QUANTIZATIONS = ("none", "4bit")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
QLORA_NEEDS_CUDA = (
    "adapter.quantization=4bit (QLoRA) stores the base model in 4-bit NF4 with bitsandbytes, whose "
    "4-bit training kernels need a CUDA GPU, and this run's device is the CPU. Train with plain LoRA "
    "instead (adapter=lora: the frozen base stays in fp32, or in bf16 with trainer.precision=bf16), which "
    "needs more memory for the frozen weights and nothing else; or run on a machine with a CUDA GPU "
    "(pip install -e '.[qlora]' in grpo-cli's folder there)."
)


def check_quantization(quantization: str, device) -> None:
    """QLoRA needs a CUDA device and bitsandbytes: said before anything is loaded."""
    if quantization == "none":
        return
    if device.type != "cuda":
        raise UserError(QLORA_NEEDS_CUDA)
    from importlib.util import find_spec

    if find_spec("bitsandbytes") is None:
        raise UserError(
            "adapter.quantization=4bit (QLoRA) needs the bitsandbytes package, which is not installed; "
            "install it with pip install -e '.[qlora]' in grpo-cli's folder (or pip install bitsandbytes), or train with "
            "plain LoRA: adapter=lora."
        )


def check_adapter(a, tr) -> list[str]:
    """The adapter group's values and what they cannot run with (config validation; the target
    names are checked against the model once it loads). a, tr: the adapter and trainer groups."""
    if a.name == "none":
        return _full_fine_tuning_problems(a)
    problems = _lora_problems(a, tr)
    if a.quantization != "none" and tr.device == "cpu":
        problems.append(QLORA_NEEDS_CUDA)
    if tr.distributed == "fsdp":
        problems.append(
            f"trainer.distributed=fsdp with adapter={a.name} is not supported: LoRA keeps the base "
            "model frozen and small enough to replicate; use trainer.distributed=ddp with adapters "
            "(or adapter=none to shard a full fine-tune)."
        )
    return problems


def _full_fine_tuning_problems(a) -> list[str]:
    """adapter.name=none with a setting that only adapters use."""
    problems = []
    if a.quantization != "none":
        problems.append(
            f"adapter.quantization={a.quantization} quantizes the frozen base model of LoRA, but "
            "adapter.name=none trains every weight; use adapter=qlora (LoRA on a 4-bit base)."
        )
    if a.path:
        problems.append(
            f"adapter.path={a.path!r} is a saved adapter, but adapter.name=none; set adapter.name=lora "
            "(or adapter=lora) to load it."
        )
    return problems


def _lora_problems(a, tr) -> list[str]:
    """LoRA's alpha, dropout (which the step-0 self-check cannot run with) and target modules."""
    problems = []
    if not a.alpha > 0:
        problems.append(
            f"adapter.alpha={a.alpha} must be > 0 (the update is scaled by alpha / r); 2*r is usual."
        )
    if not 0 <= a.dropout < 1:
        problems.append(f"adapter.dropout={a.dropout} must be in [0, 1); 0 is GRPO's usual.")
    elif a.dropout > 0 and tr.self_check:
        problems.append(
            f"adapter.dropout={a.dropout} makes the training forward random, so the trainer's log-probs differ "
            "from the sampler's by the dropout noise and the step-0 self-check would stop the run. Set "
            "adapter.dropout=0 (GRPO trains without dropout), or trainer.self_check=false to train with it."
        )
    targets = [str(t) for t in a.target_modules]
    if not targets or any(not t.strip() for t in targets):
        problems.append(
            f"adapter.target_modules={targets} must name layers, e.g. [all-linear] or [q_proj,v_proj]."
        )
    elif "all-linear" in targets and len(targets) > 1:
        problems.append(
            f"adapter.target_modules={targets}: all-linear already adapts every linear layer; give "
            "[all-linear] alone or a list of layer names."
        )
    return problems


def is_adapted(model) -> bool:
    """Whether `model` is a PEFT model (LoRA adapters on a base model)."""
    return type(model).__module__.startswith("peft.")


def disabled_adapters(model):
    """A context in which `model` computes as its base model: PEFT's disable_adapter() (each LoRA
    layer returns base_layer(x), bit for bit the base model's output). For a model without
    adapters, a no-op: the reference model is then a separate frozen copy."""
    return model.disable_adapter() if is_adapted(model) else contextlib.nullcontext()


#: The name of the frozen second adapter that holds the warmed policy (the warm-up's sft-end) as
#: the KL reference under LoRA (sft.reference=warmed): loaded beside the trained one, never merged
#: (merging would rule out QLoRA and change the base weights the sampler holds).
REFERENCE_ADAPTER = "reference"


def load_reference_adapter(model, path) -> None:
    """The adapter saved at `path` (a LoRA checkpoint: sft-end) as `model`'s frozen second
    adapter, which the reference pass activates (reference_weights); the trained one stays active."""
    training = model.training  # (PEFT's load_adapter puts the whole model in eval mode: no
    model.load_adapter(str(path), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    model.train(training)  # gradient checkpointing then, which acts in training mode only)


def reference_weights(model):
    """A context in which `model` computes as the KL reference: with its warmed adapter active
    where one is loaded (load_reference_adapter), else its base model (disabled_adapters; a
    model without adapters is a frozen copy already: a no-op)."""
    if is_adapted(model) and REFERENCE_ADAPTER in model.peft_config:
        return _active_adapter(model, REFERENCE_ADAPTER)
    return disabled_adapters(model)


@contextlib.contextmanager
def _active_adapter(model, name: str):
    """`name` active inside, the trained adapter active again after (PEFT's set_adapter marks the
    active adapter's weights trainable and the others' frozen, so the trained one is trainable again)."""
    previous = model.active_adapter
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(previous)


def linear_layer_names(model) -> list[str]:
    """The distinct names (last dotted part) of the layers LoRA can adapt: nn.Linear and GPT-2's
    Conv1D, bar the output head (the layer tied to or producing the vocabulary logits)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for name, module in model.named_modules():
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if linear and module is not head and name:
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def check_target_modules(model, target_modules: list[str]) -> None:
    """Every name in adapter.target_modules must be one of the model's linear layers."""
    if list(target_modules) == ["all-linear"]:
        return
    names = linear_layer_names(model)
    unknown = [t for t in target_modules if t not in names]
    if unknown:
        raise UserError(
            f"adapter.target_modules={list(target_modules)}: {', '.join(map(repr, unknown))} "
            f"{'is not a linear layer' if len(unknown) == 1 else 'are not linear layers'} of this model "
            f"({type(model).__name__}). Its linear layers are: {', '.join(names)}. Use some of those, "
            f"e.g. adapter.target_modules=[{','.join(names[:2])}], or [all-linear] for all of them."
        )


def add_lora(model, adapter, *, quantized: bool = False, gradient_checkpointing: bool = False):
    """Fresh LoRA adapters on `model` (a loaded transformers model, its weights then frozen), as
    the adapter section says (r, alpha, dropout, target_modules, init). Adapter weights are fp32
    whatever the base's dtype (PEFT's autocast_adapter_dtype)."""
    from peft import LoraConfig, get_peft_model

    r, alpha, dropout, init = adapter.r, adapter.alpha, adapter.dropout, adapter.init
    target_modules = list(adapter.target_modules)
    check_target_modules(model, target_modules)
    if quantized:
        model = _prepare_quantized(model, gradient_checkpointing)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules="all-linear" if list(target_modules) == ["all-linear"] else list(target_modules),
        init_lora_weights={"default": True, "gaussian": "gaussian"}[init],
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def load_lora(
    model, path: str | Path, *, trainable: bool, quantized: bool = False, gradient_checkpointing=False
):
    """The adapters saved in `path` (PEFT's format) on `model`; trainable to continue training."""
    from peft import PeftModel

    path = Path(path).expanduser()
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise UserError(
            f"{path} holds no saved LoRA adapter (missing {', '.join(missing)}); give a folder written by "
            "grpo-train with adapter=lora (outputs/.../checkpoints/step-N) or by PEFT's save_pretrained."
        )
    if quantized and trainable:
        model = _prepare_quantized(model, gradient_checkpointing)
    try:
        return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except Exception as exc:  # shape mismatch (another base model), corrupt file, ...
        raise UserError(
            f"could not load the LoRA adapter in {path} onto {type(model).__name__}: {first_line(exc, 200)}. "
            "An adapter loads only onto the base model it was trained on: set model.name_or_path to it."
        ) from exc


def _prepare_quantized(model, gradient_checkpointing: bool):
    """PEFT's preparation of a k-bit base for training (norms in fp32, input gradients on)."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def trainable_summary(model) -> str:
    """`4.9M of 139.4M parameters train (3.5%)`."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"{trained / 1e6:.1f}M of {total / 1e6:.1f}M parameters train ({100 * trained / max(total, 1):.1f}%)"
    )


def merged(model) -> Any:
    """The full transformers model with the adapters folded into its weights (W + B A * alpha/r):
    what AutoModelForCausalLM.from_pretrained loads and an inference server serves. A model
    without adapters is returned as is."""
    return model.merge_and_unload() if is_adapted(model) else model
