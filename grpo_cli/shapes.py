"""A model's shape from its config alone, for the memory estimate (grpo_cli.memory).

The config is found offline (a preset, builtin:NAME, a local folder, KNOWN_CONFIGS or the Hugging
Face cache; nothing is downloaded) and the model is built on the meta device (shapes, no storage)
to count its parameters exactly: `ModelShape`, what the estimate's formulas read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line

# The real config.json values (those that set the shapes) of the shipped presets' models and a
# common larger one, so their estimates need neither the hub nor the Hugging Face cache.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
}


# --------------------------------------------------------------------------- the model's config


def conf_dir() -> Path:
    """The shipped config folder (conf/, installed as the package grpo_cli.conf)."""
    import grpo_cli.conf

    return Path(grpo_cli.conf.__file__).resolve().parent


def model_presets() -> list[str]:
    """The names of conf/model/*.yaml: what `model=NAME` (and --model NAME) accepts."""
    return sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


def preset_source(name: str) -> str | None:
    """The name_or_path of the preset `name`, or None when `name` is not a preset."""
    if "/" in name or "\\" in name or name not in model_presets():
        return None
    from omegaconf import OmegaConf

    return str(OmegaConf.load(conf_dir() / "model" / f"{name}.yaml").name_or_path)


def model_type_offline(name_or_path: str) -> str | None:
    """The model type of a preset, local folder, shipped config or cached hub id, read cheaply
    (config.json alone, nothing built or downloaded); None where that does not tell (a built-in, a
    hub id not cached, an unreadable file): the caller then finds out when the model loads."""
    import json

    source = preset_source(name_or_path) or str(name_or_path)
    if source.startswith("builtin:"):
        return None
    if source in KNOWN_CONFIGS:
        return str(KNOWN_CONFIGS[source]["model_type"])
    path = Path(source).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
        except Exception:  # noqa: BLE001 - not a hub id: the load says what is wrong
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_model_config(name_or_path: str):
    """The transformers config of a preset name, builtin:NAME, local folder or hub id, offline.

    Nothing is downloaded: a hub id is answered from KNOWN_CONFIGS or the local Hugging Face cache
    (local_files_only), so the estimate works on a machine that cannot reach the hub.
    """
    from transformers import AutoConfig

    source = preset_source(name_or_path) or name_or_path
    if source.startswith("builtin:"):
        from grpo_cli.models import BUILTINS

        name = source[len("builtin:") :]
        if name not in BUILTINS:
            raise UserError(
                f"--model {name_or_path!r}: no built-in model {name!r}; built-ins are "
                f"{', '.join('builtin:' + n for n in BUILTINS)}."
            )
        return AutoConfig.from_pretrained(BUILTINS[name]())
    folder = Path(source).expanduser()
    if folder.is_dir():
        return _folder_config(folder, name_or_path)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise UserError(
            f"--model {name_or_path!r} is not an existing folder. Point it at a folder holding the "
            "model's config.json (e.g. one written by save_pretrained), a hub id, or a preset "
            f"({', '.join(model_presets())})."
        )
    if source in KNOWN_CONFIGS:
        values = dict(KNOWN_CONFIGS[source])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as exc:  # OSError (not cached), ValueError (bad id or unknown model type), ...
        from grpo_cli.models import _hf_cache_dir

        raise UserError(
            f"the config of --model {name_or_path!r} is not available offline ({first_line(exc, 120)}): "
            f"it is not a preset ({', '.join(model_presets())}), not a local folder, not one of the "
            f"shipped configs ({', '.join(KNOWN_CONFIGS)}) and not in the Hugging Face cache "
            f"({_hf_cache_dir()}). Download the model folder where the hub is reachable (huggingface-cli "
            f"download {source} --local-dir DIR; config.json alone is enough for the estimate), copy it "
            "here and pass --model DIR; or fix the id if it is misspelt."
        ) from exc


def _folder_config(folder: Path, shown: str):
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise UserError(
            f"--model {shown!r} is a folder without config.json; point it at a model folder written by "
            "save_pretrained (or downloaded with huggingface-cli download ID --local-dir DIR)."
        )
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as exc:  # JSONDecodeError, unknown model_type, custom code, ...
        raise UserError(
            f"could not read the config.json of --model {shown!r}: {first_line(exc, 160)}. Fix or "
            "re-download the file; a model with custom code (trust_remote_code) cannot be estimated."
        ) from exc


# --------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    total_params: int  # every parameter once (tied embeddings counted once)
    linear_params: int  # weights and biases of the nn.Linear / Conv1D layers bar the output head
    linear_layers: tuple[tuple[int, int], ...]  # (in_features, out_features) of those layers
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def linear_weight_params(self) -> int:
        """The linear layers' weight matrices: what 4-bit quantization stores in NF4."""
        return sum(i * o for i, o in self.linear_layers)


def model_shape(config, *, classifier: bool = False) -> ModelShape:
    """Exact parameter counts from the model built on the meta device (no memory, no weights).
    classifier: the sequence classifier of that config (a reward model: a scoring head, no LM head).

    Counting the built modules, not a formula, keeps every architecture's biases, norms, tied heads
    and extra projections right; the linear layers are the ones PEFT's target_modules="all-linear"
    adapts: nn.Linear and transformers' Conv1D (GPT-2), bar the output head.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.pytorch_utils import Conv1D

    try:
        with torch.device("meta"):
            model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(
                config
            )
    except Exception as exc:  # an architecture without a causal-LM class, custom code, a bad config
        raise UserError(
            f"cannot build a causal LM from the {getattr(config, 'model_type', '?')!r} config: "
            f"{first_line(exc, 160)}. grpo-cli trains models that AutoModelForCausalLM supports."
        ) from exc
    head = model.get_output_embeddings()
    layers, linear_params = [], 0
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            layers.append((module.in_features, module.out_features))
        elif isinstance(module, Conv1D):
            layers.append((module.weight.shape[0], module.nf))  # weight [in, out]
        else:
            continue
        linear_params += sum(p.numel() for p in module.parameters(recurse=False))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    inter = next(
        (getattr(text, k) for k in ("intermediate_size", "ffn_dim", "n_inner") if getattr(text, k, None)),
        4 * hidden,
    )
    return ModelShape(
        model_type=str(getattr(config, "model_type", "?")),
        total_params=sum(p.numel() for p in model.parameters()),  # parameters() skips tied duplicates
        linear_params=linear_params,
        linear_layers=tuple(layers),
        num_layers=int(text.num_hidden_layers),
        hidden_size=hidden,
        intermediate_size=int(inter),
        vocab_size=int(text.vocab_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
    )


def lora_parameters(shape: ModelShape, r: int) -> int:
    """Trainable parameters of LoRA rank r on every linear layer: A [r, in] and B [out, r] each."""
    return sum(r * (i + o) for i, o in shape.linear_layers)
