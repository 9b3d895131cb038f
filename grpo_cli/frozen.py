"""The frozen models a run scores with besides the policy: the KL reference (loss.beta > 0) and
on-policy distillation's teacher (loss.teacher_kl > 0), loaded one way (load_frozen): on the
training device, in the precision's weights dtype (or in bf16: trainer.frozen_precision), sharded
under FSDP2 as the policy is. After a warm-up (sft=demonstrations) the reference is the warmed
policy (warmed_reference; under LoRA the warmed adapter beside the trained one:
adapters.load_reference_adapter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_cli.adapters import is_adapted, load_reference_adapter
from grpo_cli.config import Config
from grpo_cli.distributed import shard_model
from grpo_cli.models import ModelSource, load_model
from grpo_cli.precision import frozen_weights_dtype, to_weights_dtype


def model_kw(cfg: Config) -> dict[str, Any]:
    return dict(revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)


def _frozen_kw(cfg: Config) -> dict[str, Any]:
    """load_frozen's options for the model's own weights: model_kw and trainer.frozen_precision."""
    return dict(model_kw(cfg), frozen_precision=cfg.trainer.frozen_precision)


def load_frozen(
    source: ModelSource,
    at,
    fsdp: bool,
    *,
    key: str = "model.name_or_path",
    frozen_precision: str = "same",
    **model_kw,
):
    """A frozen model (eval, no grad: the reference, the teacher) from `source` on at.device, stored
    in the precision's weights dtype (as the policy's, not from_pretrained's; bf16 with
    frozen_precision=bf16, trainer.frozen_precision: precision.frozen_weights_dtype) and sharded
    under FSDP2 as the policy is. model_kw: load_model's revision and trust_remote_code; `key` names
    the setting. Loaded in fp32 and converted, as the policy is: buffers (rotary frequencies) stay
    fp32."""
    model = load_model(source, device=at.device, trainable=False, key=key, **model_kw)
    dtype = frozen_weights_dtype(at.precision, frozen_precision)
    if dtype is not None:
        to_weights_dtype(model, dtype)
    if fsdp:
        shard_model(model)
    return model


def reference(cfg: Config, policy, source: ModelSource, at, fsdp: bool, warmed: Path | None):
    """The reference model, which exists only when the KL term does (beta > 0): frozen, eval, no
    grad. With adapters it is the policy itself, run with its adapters disabled (or, after a
    warm-up, its warmed adapter active: adapters.reference_weights); otherwise a second copy of the
    base model, in the policy's dtype (bf16 under trainer.frozen_precision=bf16). `warmed`: the
    warm-up's sft-end, where the reference is the warmed policy (sft.reference=warmed) and the
    warm-up has run; None where it has yet to run (None for now: stages.py loads it when the
    warm-up ends) or there is none."""
    if cfg.loss.beta <= 0:
        return None
    pending = cfg.sft.name != "none" and cfg.sft.reference == "warmed"
    if is_adapted(policy):
        if pending and warmed is not None:
            load_reference_adapter(policy, warmed)
        return policy
    if pending:
        return None if warmed is None else warmed_reference(cfg, warmed, at, fsdp)
    return load_frozen(source, at, fsdp, **_frozen_kw(cfg))


def warmed_reference(cfg: Config, warmed: Path, at, fsdp: bool):
    """The warmed policy (the warm-up's checkpoint sft-end) as a frozen copy: full fine-tuning's
    KL reference under sft.reference=warmed."""
    source = ModelSource(str(warmed), None, f"the warmed policy ({warmed})")
    return load_frozen(source, at, fsdp, key="sft.reference", **_frozen_kw(cfg))


def teacher_model(cfg: Config, source: ModelSource | None, at, fsdp: bool):
    """On-policy distillation's teacher (teacher.py's teacher_source found it), frozen as the
    reference is, on the training device; None without a teacher (source None)."""
    if source is None:
        return None
    te = cfg.teacher
    return load_frozen(
        source,
        at,
        fsdp,
        key="teacher.name_or_path",
        revision=te.revision,
        trust_remote_code=te.trust_remote_code,
        frozen_precision=cfg.trainer.frozen_precision,
    )
