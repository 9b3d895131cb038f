"""The policy's chat template, rendered one way wherever it is rendered (the data's prompts, and
so grpo-eval's and the warm-up's; an environment's prompts, tool lists and replies): with
model.chat_template_kwargs, the keyword arguments its Jinja template reads beside the messages
(TRL's name), e.g. Qwen3's {enable_thinking: false}.

The policy's tokenizer carries them, as it carries model.chat_template: they are attached once
where the tokenizer is built from the model section (with_template_kwargs), and every rendering
goes through `render`, which takes the tokenizer. So whatever gets the policy's tokenizer renders
with them, and a reward model's or a judge's template, whose tokenizers are their own, never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The attribute of a tokenizer that holds its template's keyword arguments (a plain dict: it
# survives copy.deepcopy and pickling with the tokenizer).
_ATTRIBUTE = "grpo_cli_chat_template_kwargs"

# Keys grpo-cli sets itself on every rendering (the template's messages and tools, whether it ends
# with the assistant's turn, and text rather than token ids), and apply_chat_template's own options,
# which change the call rather than reach the template: neither may come from the config.
OWN_KEYS = ("tools", "add_generation_prompt", "tokenize", "messages", "conversation")
CALL_OPTIONS = (
    "chat_template",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "padding",
    "truncation",
    "max_length",
)


def with_template_kwargs(tokenizer, kwargs: Mapping[str, Any] | None):
    """The policy's `tokenizer`, carrying model.chat_template_kwargs (`kwargs`) for `render`;
    returned for convenience (the same object)."""
    setattr(tokenizer, _ATTRIBUTE, _plain(dict(kwargs or {})))
    return tokenizer


def template_kwargs(tokenizer) -> dict[str, Any]:
    """The keyword arguments `tokenizer`'s template is rendered with ({} where none were attached)."""
    return dict(getattr(tokenizer, _ATTRIBUTE, None) or {})


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True, tools=None) -> str:
    """`messages` through the tokenizer's chat template, as text, with the keyword arguments it
    carries (model.chat_template_kwargs); tools: JSON schemas the template lists (None: none)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **extra,
        **template_kwargs(tokenizer),
    )


def check_template_kwargs(kwargs: Any) -> list[str]:
    """model.chat_template_kwargs's problems (config validation): a mapping of template variable
    names to plain YAML values, none of them a key grpo-cli sets or an option of the call."""
    kwargs = _container(kwargs)
    if kwargs is None:
        return []
    if not isinstance(kwargs, Mapping):
        return [
            f"model.chat_template_kwargs={kwargs!r} is not a mapping; give the chat template's variables by "
            "name, e.g. 'model.chat_template_kwargs={enable_thinking: false}' (or {} for none)."
        ]
    problems = []
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            problems.append(
                f"model.chat_template_kwargs has the key {key!r}, which is not a name a Jinja template can "
                "read; spell it as the template does (a variable name such as enable_thinking), or drop it."
            )
        elif key in OWN_KEYS:
            problems.append(
                f"model.chat_template_kwargs.{key} is set, and {key!r} is grpo-cli's to give the chat template "
                f"on every rendering ({', '.join(OWN_KEYS)}: the messages, environment.tools under "
                "environment.protocol=native, the assistant's turn to come, text rather than token ids); "
                f"drop model.chat_template_kwargs.{key}."
            )
        elif key in CALL_OPTIONS:
            instead = (
                "set model.chat_template to the template instead"
                if key == "chat_template"
                else f"drop model.chat_template_kwargs.{key}"
            )
            problems.append(
                f"model.chat_template_kwargs.{key} is an option of tokenizer.apply_chat_template, not a variable "
                f"of the template: it would change how grpo-cli renders prompts rather than what the template "
                f"says; {instead}."
            )
        elif (bad := _not_plain(value)) is not None:
            problems.append(
                f"model.chat_template_kwargs.{key} holds {bad}, which is not a plain YAML value; give a "
                "string, number, boolean, null, or a list or mapping (string keys) of those."
            )
    return problems


def _container(value: Any) -> Any:
    """An OmegaConf node as plain Python (the composed config's); anything else as it is."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _not_plain(value: Any) -> str | None:
    """The first part of `value` that is not a plain YAML value, described (None where all is)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, (list, tuple)):
        return next((bad for item in value if (bad := _not_plain(item)) is not None), None)
    if isinstance(value, Mapping):
        for k, item in value.items():
            if not isinstance(k, str):
                return f"the key {k!r} ({type(k).__name__})"
            if (bad := _not_plain(item)) is not None:
                return bad
        return None
    return f"{value!r} ({type(value).__name__})"


def _plain(value: Any) -> Any:
    """`value` as plain Python containers (an OmegaConf node's contents; a copy, so the caller's
    config and the tokenizer's kwargs never share a list or a mapping)."""
    value = _container(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
