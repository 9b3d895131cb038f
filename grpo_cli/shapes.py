"""A model's shape from its config alone, for the memory estimate (grpo_cli.memory).

The config is found offline (a preset, builtin:NAME, a local folder, KNOWN_CONFIGS or the Hugging
Face cache; nothing is downloaded) and the model is built on the meta device (shapes, no storage)
to count its parameters exactly: `ModelShape`, what the estimate's formulas read.
"""

from __future__ import annotations

import copy
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
    # Qwen3-0.6B's config.json, as mirrored at huggingface.co/TensorStack/TextEncoder (Qwen-3-06B/
    # config.json, a copy of Qwen/Qwen3-0.6B/raw/main/config.json) and quoted in full by other
    # public code that cites that URL; every value here is from it (sliding_window null,
    # max_window_layers 28 and torch_dtype set nothing the estimate reads and are left out).
    "Qwen/Qwen3-0.6B": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen3.5-0.8B is natively multimodal: its config.json (model_type qwen3_5) holds a text_config
    # (qwen3_5_text: 24 layers, 3 Gated DeltaNet linear-attention layers to 1 full attention) and a
    # vision_config. The values are those of the copy of its config.json in wlejon/brolm
    # (tests/test_qwen35_config.cpp, "Compact mirror of Qwen/Qwen3.5-0.8B's config.json"); the same
    # text values (1024 hidden, 3584 intermediate, 8 heads / 2 KV heads of 256, 16 + 16 linear
    # heads of 128, kernel 4, vocab 248320, tied embeddings, rope_theta 1e7, partial rotary 0.25)
    # are in other public Qwen3.5-0.8B loaders (a text-backbone config "of the official
    # Qwen3.5-0.8B(-Base)", a mini-SGLang port's config check), its vision values (depth 12, 768 wide,
    # 12 heads, intermediate 3072, out 1024, gelu_pytorch_tanh) in a compiler pinned to this model.
    # Its token ids (bos/eos/pad) were not found in a copy of the file and are left out: nothing
    # here reads them. AutoModelForCausalLM builds the text model alone (Qwen3_5ForCausalLM, what
    # grpo-cli trains: 752,393,024 parameters, the head tied); the checkpoint's vision tower
    # (Qwen3_5ForConditionalGeneration: 852,985,920 with it) and its multi-token-prediction layer
    # (mtp_num_hidden_layers 1, which transformers does not load) are not part of it.
    "Qwen/Qwen3.5-0.8B": dict(
        model_type="qwen3_5",
        tie_word_embeddings=True,
        image_token_id=248056,
        video_token_id=248057,
        vision_start_token_id=248053,
        vision_end_token_id=248054,
        text_config=dict(
            model_type="qwen3_5_text",
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            attention_bias=False,
            attn_output_gate=True,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            full_attention_interval=4,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
            max_position_embeddings=262144,
            tie_word_embeddings=True,
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
            rope_parameters=dict(
                rope_type="default",
                mrope_interleaved=True,
                mrope_section=[11, 11, 10],
                rope_theta=10000000,
                partial_rotary_factor=0.25,
            ),
        ),
        vision_config=dict(
            depth=12,
            hidden_size=768,
            num_heads=12,
            intermediate_size=3072,
            hidden_act="gelu_pytorch_tanh",
            in_channels=3,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=1024,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[],
        ),
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
        values = copy.deepcopy(KNOWN_CONFIGS[source])  # (sub-configs are dicts the config may keep)
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


# Kinds of non-attention layers (MixerShape.kind): their token mixer keeps a state of fixed size
# per sequence instead of keys and values that grow with it.
# - GATED_DELTANET: linear attention, Qwen3.5 and Qwen3-Next (layer_types linear_attention);
# - SHORT_CONV: LFM2's gated short convolution (layer_types conv);
# - MAMBA2: granitemoehybrid's Mamba-2 (layer_types mamba, which transformers renames linear_attention).
GATED_DELTANET = "gated_deltanet"
SHORT_CONV = "short_conv"
MAMBA2 = "mamba2"


@dataclass(frozen=True)
class MixerShape:
    """The layers of one non-attention kind (GATED_DELTANET, SHORT_CONV, MAMBA2), read from the built
    modules: how many, and the widths memory.py's formulas read."""

    kind: str
    layers: int
    conv_channels: int  # channels of the causal depthwise convolution (its cache: conv_kernel columns each)
    conv_kernel: int
    heads: int  # heads of the recurrent scan: value heads (Gated DeltaNet), Mamba heads; 0 for a short conv
    key_dim: int  # a head's key width (Gated DeltaNet) or state size (Mamba-2, d_state)
    value_dim: int  # a head's value width (Gated DeltaNet) or head_dim (Mamba-2)
    inner: int  # the mixer's output width before out_proj (heads x value_dim; a short conv's: hidden)
    in_proj: int  # the width of its input projections together
    chunk: int  # the sequence chunk of its PyTorch scan (0 for a short conv)

    @property
    def recurrent_state(self) -> int:
        """Elements of one sequence's recurrent state in one layer (heads x key_dim x value_dim)."""
        return self.heads * self.key_dim * self.value_dim


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    total_params: int  # every parameter once (tied embeddings counted once)
    linear_params: int  # weights and biases of the nn.Linear / Conv1D layers bar the output head
    linear_layers: tuple[tuple[int, int], ...]  # (in_features, out_features) of those layers
    num_layers: int
    hidden_size: int
    intermediate_size: int  # the MLP's width (a short conv model's or a MoE's: as built, see _mlp_width)
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # The non-attention layers by kind (() for a model of attention layers only); the others are
    # attention layers, with a KV cache.
    mixers: tuple[MixerShape, ...] = ()
    # Its layers keep a recurrent or convolution state (models.RECURRENT_MODEL_TYPES, or mixers):
    # its training forward runs full rows (logprobs.forward.prompt_runs_once), no shared prompt.
    recurrent: bool = False

    @property
    def linear_weight_params(self) -> int:
        """The linear layers' weight matrices: what 4-bit quantization stores in NF4."""
        return sum(i * o for i, o in self.linear_layers)

    @property
    def attention_layers(self) -> int:
        """The layers with attention (and a KV cache)."""
        return self.num_layers - sum(m.layers for m in self.mixers)


def model_shape(config, *, classifier: bool = False) -> ModelShape:
    """Exact parameter counts from the model built on the meta device (no memory, no weights).
    classifier: the sequence classifier of that config (a reward model: a scoring head, no LM head).

    Counting the built modules, not a formula, keeps every architecture's biases, norms, tied heads
    and extra projections right; the linear layers are the ones PEFT's target_modules="all-linear"
    adapts: nn.Linear and transformers' Conv1D (GPT-2), bar the output head. A multimodal config
    (Qwen3.5's) gives the text model AutoModelForCausalLM builds, as grpo-cli trains it. The decoder
    layers' kinds (attention, or a mixer with a fixed-size state: MixerShape) are read from them too.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.pytorch_utils import Conv1D

    from grpo_cli.models import RECURRENT_MODEL_TYPES

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
    decoder = _decoder_layers(model, int(text.num_hidden_layers))
    mixers = _mixers(decoder)
    types = {getattr(config, "model_type", None), getattr(text, "model_type", None)}
    return ModelShape(
        model_type=str(getattr(config, "model_type", "?")),
        total_params=sum(p.numel() for p in model.parameters()),  # parameters() skips tied duplicates
        linear_params=linear_params,
        linear_layers=tuple(layers),
        num_layers=int(text.num_hidden_layers),
        hidden_size=hidden,
        intermediate_size=_mlp_width(decoder[0] if decoder else None, text, int(inter)),
        vocab_size=int(text.vocab_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        mixers=mixers,
        recurrent=bool(mixers) or bool(types & set(RECURRENT_MODEL_TYPES)),
    )


def _decoder_layers(model, num_layers: int) -> list:
    """The decoder's layers: the first ModuleList of num_hidden_layers modules ([] if none is)."""
    import torch

    return next(
        (list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), []
    )


def _mixer(layer) -> MixerShape | None:
    """The MixerShape (layers=1) of a decoder layer's non-attention token mixer, None for an attention
    layer. Found by the attributes transformers' modules carry: Gated DeltaNet (head_k_dim,
    num_v_heads), Mamba-2 (ssm_state_size, n_groups, head_dim) and LFM2's short convolution."""
    for m in layer.modules():
        if all(hasattr(m, a) for a in ("head_k_dim", "head_v_dim", "num_v_heads", "conv_dim")):
            return MixerShape(
                GATED_DELTANET,
                1,
                conv_channels=int(m.conv_dim),
                conv_kernel=int(m.conv_kernel_size),
                heads=int(m.num_v_heads),
                key_dim=int(m.head_k_dim),
                value_dim=int(m.head_v_dim),
                inner=int(m.value_dim),
                in_proj=int(m.conv_dim) + int(m.value_dim) + 2 * int(m.num_v_heads),  # qkv, z, b, a
                chunk=64,  # torch_chunk_gated_delta_rule's default, which the layers use
            )
        if all(hasattr(m, a) for a in ("ssm_state_size", "n_groups", "head_dim", "conv_dim", "in_proj")):
            return MixerShape(
                MAMBA2,
                1,
                conv_channels=int(m.conv_dim),
                conv_kernel=int(m.conv_kernel_size),
                heads=int(m.num_heads),
                key_dim=int(m.ssm_state_size),
                value_dim=int(m.head_dim),
                inner=int(m.intermediate_size),
                in_proj=int(m.in_proj.out_features),
                chunk=int(m.chunk_size),
            )
        if type(m).__name__.endswith("ShortConv") and hasattr(m, "in_proj") and hasattr(m, "conv"):
            return MixerShape(
                SHORT_CONV,
                1,
                conv_channels=int(m.conv.in_channels),
                conv_kernel=int(m.conv.kernel_size[0]),
                heads=0,
                key_dim=0,
                value_dim=0,
                inner=int(m.out_proj.in_features),
                in_proj=int(m.in_proj.out_features),
                chunk=0,
            )
    return None


def _mixers(decoder: list) -> tuple[MixerShape, ...]:
    """The decoder's non-attention layers, one MixerShape per kind and widths (layers: how many)."""
    from collections import Counter

    counts = Counter(m for m in map(_mixer, decoder) if m is not None)
    return tuple(MixerShape(**{**m.__dict__, "layers": n}) for m, n in counts.items())


def _mlp_width(layer, text, default: int) -> int:
    """The width of a decoder layer's MLP as built: its down projection's input (mlp.down_proj,
    LFM2's feed_forward.w2, which its block_auto_adjust_ff_dim sizes away from intermediate_size;
    granitemoehybrid's shared_mlp, plus num_experts_per_tok experts of intermediate_size when it has
    experts); the config's intermediate size where no such module is (GPT-2's Conv1D, a MoE's experts)."""
    import torch

    for name, down in (("mlp", "down_proj"), ("feed_forward", "w2"), ("shared_mlp", "output_linear")):
        proj = getattr(getattr(layer, name, None), down, None)
        if isinstance(proj, torch.nn.Linear):
            experts = int(getattr(text, "num_local_experts", 0) or 0) if name == "shared_mlp" else 0
            top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
            return int(proj.in_features) + (top_k * int(text.intermediate_size) if experts else 0)
    return default


def lora_parameters(shape: ModelShape, r: int) -> int:
    """Trainable parameters of LoRA rank r on every linear layer: A [r, in] and B [out, r] each."""
    return sum(r * (i + o) for i, o in shape.linear_layers)
