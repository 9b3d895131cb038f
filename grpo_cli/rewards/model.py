"""A reward model: a sequence classifier with one label (AutoModelForSequenceClassification), whose
score of (prompt, completion) is the reward.

    reward=model reward.model.name_or_path=DIR

Its own tokenizer and chat template render the conversation (the prompt's messages, then the
completion as the assistant's turn; the completion's messages for an environment's episode), never
the policy's tokens: the two models' vocabularies need not agree (TRL #1979). Without a chat
template the text is the prompt followed by the completion. Batches of `batch_size` texts, right
padded (the classifier pools its last token that is not padding, as a plain transformers forward
does), at most `max_length` tokens (longer texts lose their start: the completion, at the end, is
what is scored). The model is loaded once per process when the run starts, on the training
device in the trainer's precision (fp32, or bf16 under trainer.precision=bf16), frozen, and run
without autograd; it is freed when the run ends. Its weights load from safetensors only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from ._common import RewardError, check_int, check_unknown, completion_text
from .base import Reward


@dataclass(frozen=True)
class Options:
    """model's options (reward.model.<option>): the one place their defaults live."""

    name_or_path: Optional[str] = None  # a folder written by save_pretrained, or a hub id (required)
    batch_size: int = 8  # texts per forward
    max_length: int = 1024  # tokens per text, at most (the start is cut: truncation_side left)
    revision: Optional[str] = None
    trust_remote_code: bool = False


ROLE = "shaping"
OPTIONS = tuple(f.name for f in fields(Options))
_D = Options()


def check_options(options: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    check_unknown(problems, options, OPTIONS)
    path = options.get("name_or_path")
    if not isinstance(path, str) or not path.strip():
        problems.append(
            f"name_or_path={path!r}: give the reward model, a folder written by save_pretrained or a hub "
            "id (reward.model.name_or_path=DIR); it must be a sequence classifier with one label"
        )
    elif path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        problems.append(
            f"name_or_path={path!r} is not an existing folder; point it at a folder holding the reward "
            "model's config.json, safetensors weights and tokenizer"
        )
    check_int(problems, "batch_size", options.get("batch_size", _D.batch_size), minimum=1)
    check_int(problems, "max_length", options.get("max_length", _D.max_length), minimum=1)
    return problems


def _messages(prompt: Any, completion: Any) -> list[dict]:
    """The conversation the reward model reads: the prompt's messages (a plain-text prompt as the
    user's), then the completion's (a plain completion as the assistant's)."""
    head = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if isinstance(completion, list):
        return head + list(completion)
    return head + [{"role": "assistant", "content": completion_text(completion)}]


class Scorer:
    """The loaded reward model and its tokenizer; called with TRL's signature."""

    def __init__(self, model, tokenizer, *, batch_size: int, max_length: int, described: str):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length, self.described = batch_size, max_length, described

    def texts(self, prompts: list, completions: list) -> list[str]:
        tok = self.tokenizer
        if tok.chat_template:
            return [
                tok.apply_chat_template(_messages(p, c), tokenize=False) for p, c in zip(prompts, completions)
            ]
        return [
            (p if isinstance(p, str) else "\n".join(m["content"] for m in p)) + completion_text(c)
            for p, c in zip(prompts, completions)
        ]

    def scores(self, texts: list[str]) -> list[float]:
        import torch

        tok, out = self.tokenizer, []
        device = next(self.model.parameters()).device
        for start in range(0, len(texts), self.batch_size):
            batch = tok(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                # A chat template writes its own special tokens (a BOS where the model wants one).
                add_special_tokens=not tok.chat_template,
            ).to(device)
            with torch.inference_mode():
                logits = self.model(**batch).logits  # [b, 1]
            out += logits[:, 0].float().tolist()
        return out

    def __call__(self, completions: list, prompts: list | None = None, **_) -> list[float]:
        if prompts is None:
            raise RewardError("the model reward needs the prompts (the engine passes them)")
        return self.scores(self.texts(prompts, completions))


def load(device=None, dist=None, dtype=None, **options) -> Scorer:
    """The reward model on `device` in `dtype` (None: fp32), frozen, and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from grpo_cli.models import _load_error, disable_dropout, resolve_source

    o = Options(**options)
    key = "reward.model.name_or_path"
    source = resolve_source(o.name_or_path, log=lambda *_: None)
    common = dict(
        revision=o.revision, trust_remote_code=o.trust_remote_code, local_files_only=source.local_files_only
    )
    try:
        config = AutoConfig.from_pretrained(source.path, **common)
    except Exception as exc:
        raise _load_error(source, exc, key=key, path=o.name_or_path) from exc
    labels = getattr(config, "num_labels", None)
    if labels != 1:
        raise RewardError(
            f"reward.model.name_or_path={o.name_or_path!r} is a model with {labels} labels; a reward model "
            "scores with one (a sequence classifier with num_labels=1, as TRL's RewardTrainer trains). "
            "Use a reward model, or make one from a causal LM with "
            "AutoModelForSequenceClassification.from_pretrained(LM, num_labels=1) and train its head."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, **common)
        model = AutoModelForSequenceClassification.from_pretrained(
            source.path, dtype=dtype or torch.float32, use_safetensors=True, **common
        )
    except Exception as exc:
        raise _load_error(source, exc, key=key, path=o.name_or_path) from exc
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"  # (the completion, at the end, is what is scored)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # (the classifier finds each text's last token by it)
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device or "cpu").eval().requires_grad_(False)
    disable_dropout(model)
    return Scorer(
        model, tokenizer, batch_size=o.batch_size, max_length=o.max_length, described=source.description
    )


def free(scorer: Scorer) -> None:
    """Drops the model (and the device's cached blocks, on a GPU)."""
    import torch

    device = next(scorer.model.parameters()).device
    scorer.model = scorer.tokenizer = None
    if device.type == "cuda":
        torch.cuda.empty_cache()


def from_causal_lm(lm: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """A reward model made from a causal LM's folder: its body, a new one-label scoring head
    (random, from `seed`), its tokenizer; saved to `out` as safetensors. Its scores mean nothing
    until the head is trained (TRL's RewardTrainer), but it has a real model's shape and cost: what
    the tests and the benchmarks score with. Returns `out`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lm)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1, use_safetensors=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


REWARD = Reward(name="model", build=load, close=free, options=Options, check=check_options, role=ROLE)
