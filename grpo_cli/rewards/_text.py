"""The text the rewards see: a rollout's completions decoded the same way under every transformers
version (`decode_completions`), and an episode's completion side as chat messages
(`conversation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# transformers 4.x's clean-up of tokenization spaces (PreTrainedTokenizerBase.clean_up_tokenization).
_SPACE_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_spaces(text: str) -> str:
    for before, after in _SPACE_CLEANUP:
        text = text.replace(before, after)
    return text


def decode_completions(tokenizer, completion_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    """The completions' text, as the rewards see it (the reward span: every attended completion
    token, rollout.Rollout.attention_mask). Decoding is explicit so that the text (and so
    the rewards) does not depend on the transformers version: 4.x applies the tokenizer's
    `clean_up_tokenization_spaces` setting, 5.x ignores it for BPE tokenizers (SmolLM2's "15 ."
    instead of "15."). So: decode without the clean-up, then apply 4.x's when the tokenizer asks."""
    texts = tokenizer.batch_decode(
        [ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, attention_mask)],
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [clean_up_spaces(t) for t in texts]
    return texts


def conversation(tokenizer, ids, roles) -> list[dict]:
    """An episode's completion side as chat messages: each run of tokens one writer wrote
    (rollout.ROLE_CODES), decoded; an environment's message without the chat template's text
    around it (its role header, the next assistant turn's)."""
    from grpo_cli.rollout import ROLE_NAMES

    messages, start = [], 0
    codes = roles.tolist()
    for end in range(1, len(codes) + 1):
        if end < len(codes) and codes[end] == codes[start]:
            continue
        role = ROLE_NAMES[codes[start]]
        if role != "padding":
            text = tokenizer.decode(
                ids[start:end].tolist(), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
            if getattr(tokenizer, "clean_up_tokenization_spaces", False):
                text = clean_up_spaces(text)
            if role != "assistant":
                text = text.strip()
                text = text[len(role) :].lstrip() if text.startswith(role + "\n") else text
                text = text[: -len("assistant")].rstrip() if text.endswith("\nassistant") else text
            messages.append({"role": role, "content": text})
        start = end
    return messages
