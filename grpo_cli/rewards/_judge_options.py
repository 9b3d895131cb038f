"""The judge reward's options and text (rewards/judge.py holds the reward and its HTTP client):
the Options dataclass and its check, the prompt template and its fields, how a prompt is
rendered for the judge and how its reply is parsed. The semantics are in judge.py's module doc.
Private (its name starts with "_"): the registry does not take it for a reward.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional  # (Optional: OmegaConf reads Options' types)

from ._common import (
    RewardError,
    check_choice,
    check_int,
    check_real,
    check_unknown,
    completion_text,
)

PARSES = ("number", "yes_no")
ON_ERROR = ("raise", "nan")
#: The judge's prompt when `template` is null, per `parse`.
TEMPLATES = {
    "number": (
        "Rate how well the response answers the prompt, on a scale from {min_score:g} (useless or "
        "wrong) to {max_score:g} (excellent). Reply with the number only.\n\n"
        "Prompt:\n{prompt}\n\nResponse:\n{completion}\n\nScore:"
    ),
    "yes_no": (
        "Does the response correctly and fully answer the prompt? Reply with yes or no only.\n\n"
        "Prompt:\n{prompt}\n\nResponse:\n{completion}\n\nAnswer:"
    ),
}
#: Template fields the judge fills itself; every other field is a dataset column.
OWN_FIELDS = ("prompt", "completion", "min_score", "max_score")
_PREVIEW = 100


@dataclass(frozen=True)
class Options:
    """judge's options (reward.judge.<option>): the one place their defaults live."""

    base_url: Optional[str] = None  # required: the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1
    model: Optional[str] = None  # required: the judge model's name on that server
    api_key_env: Optional[str] = None  # the environment variable holding the API key (Bearer); null: none
    template: Optional[str] = (
        None  # the judge's prompt (str.format; see judge.py's module doc); null: TEMPLATES[parse]
    )
    system: Optional[str] = None  # a system message for the judge; null: none
    parse: str = "number"  # PARSES: how the reply becomes a reward
    min_score: float = 0.0  # parse=number: the lowest score (reward 0)
    max_score: float = 10.0  # parse=number: the highest score (reward 1)
    concurrency: int = 8  # at most this many calls of this judge at a time
    timeout_s: float = 30.0  # per call
    retries: int = 3  # re-sends after a 429, 5xx, timeout or connection error
    backoff_s: float = 0.5  # the first retry's wait, doubled at each next one
    max_tokens: int = 16  # of the judge's reply
    temperature: float = 0.0
    on_error: str = "raise"  # ON_ERROR: a call that fails raises, or scores NaN


OPTIONS = tuple(f.name for f in fields(Options))
_D = Options()


# --------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------


def _template(options: Mapping[str, Any]) -> str:
    template = options.get("template", _D.template)
    if template is None:
        return TEMPLATES.get(options.get("parse", _D.parse), TEMPLATES["number"])
    return template


def _template_fields(template: str) -> list[str]:
    """The template's field names (their base: {answer[0]} -> answer), in order, once each;
    ValueError for a bad format string or a positional field."""
    found: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not base or base.isdigit():
            raise ValueError(
                f"the field {{{name}}} is positional; name it ({{prompt}}, {{completion}}, {{answer}})"
            )
        if base not in found:
            found.append(base)
    return found


def _template_problem(template: Any) -> str | None:
    if not isinstance(template, str) or not template.strip():
        return f"option template must be a non-empty string (or null for the default), got {template!r:.80}"
    try:
        names = _template_fields(template)
        options = [n for n in names if n in OPTIONS and n not in OWN_FIELDS]
        if options:
            return (
                f"option template uses {', '.join('{' + n + '}' for n in options)}, the name of a judge "
                "option, not of a dataset column; rename the column"
            )
        # A trial format: a format spec that cannot apply ({answer:d} to text) fails here, not mid-run.
        trial = {n: "x" for n in names} | {"min_score": 0.0, "max_score": 10.0}
        template.format(**trial)
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as exc:
        return (
            f"option template is not a valid str.format template ({exc}); write fields as {{prompt}}, "
            "{completion} or {column} and literal braces as {{ and }}"
        )
    return None


def check_options(options: Mapping[str, Any], *, unknown: bool = True) -> list[str]:
    """Problems with judge's options (``unknown``: also flag unknown keys), all at once."""
    problems: list[str] = []
    if unknown:
        check_unknown(problems, options, OPTIONS)
    base_url = options.get("base_url", _D.base_url)
    if base_url is None:
        problems.append(
            "option base_url is required: the judge server's OpenAI-compatible API, "
            "e.g. reward.judge.base_url=http://127.0.0.1:8000/v1"
        )
    elif not isinstance(base_url, str) or not re.fullmatch(r"https?://[^\s/]+\S*", base_url.strip()):
        problems.append(f"option base_url must be an http:// or https:// URL, got {base_url!r}")
    model = options.get("model", _D.model)
    if model is None:
        problems.append(
            "option model is required: the judge model's name on the server (reward.judge.model=...)"
        )
    elif not isinstance(model, str) or not model.strip():
        problems.append(f"option model must be a non-empty string, got {model!r}")
    key_env = options.get("api_key_env", _D.api_key_env)
    if key_env is not None and (not isinstance(key_env, str) or not key_env.strip()):
        problems.append(f"option api_key_env must be the name of an environment variable, got {key_env!r}")
    system = options.get("system", _D.system)
    if system is not None and not isinstance(system, str):
        problems.append(f"option system must be a string or null, got {system!r:.80}")
    parse = options.get("parse", _D.parse)
    check_choice(problems, "parse", parse, PARSES)
    template = options.get("template", _D.template)
    if template is not None:
        problem = _template_problem(template)
        if problem:
            problems.append(problem)
    lo, hi = options.get("min_score", _D.min_score), options.get("max_score", _D.max_score)
    n = len(problems)
    check_real(problems, "min_score", lo)
    check_real(problems, "max_score", hi)
    if len(problems) == n and lo >= hi:
        problems.append(f"option min_score ({lo!r}) must be less than max_score ({hi!r})")
    check_int(problems, "concurrency", options.get("concurrency", _D.concurrency), minimum=1)
    check_real(problems, "timeout_s", options.get("timeout_s", _D.timeout_s), strictly_positive=True)
    check_int(problems, "retries", options.get("retries", _D.retries), minimum=0)
    check_real(problems, "backoff_s", options.get("backoff_s", _D.backoff_s), minimum=0)
    check_int(problems, "max_tokens", options.get("max_tokens", _D.max_tokens), minimum=1)
    check_real(problems, "temperature", options.get("temperature", _D.temperature), minimum=0)
    check_choice(problems, "on_error", options.get("on_error", _D.on_error), ON_ERROR)
    return problems


def columns(options: Mapping[str, Any]) -> list[str]:
    """The dataset columns the judge's template reads (its fields but prompt, completion and the
    score range)."""
    try:
        return [n for n in _template_fields(_template(options)) if n not in OWN_FIELDS]
    except ValueError:
        return []  # check_options reports it


# --------------------------------------------------------------------------
# rendering and parsing
# --------------------------------------------------------------------------


def render_prompt(prompt: Any) -> str:
    """A prompt as the judge reads it: a string as it is; chat messages without their system
    messages, then the one left as its content, or several as `role: content` lines."""
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        prompt = [prompt]
    messages = [m for m in prompt if not (isinstance(m, Mapping) and m.get("role") == "system")]
    if len(messages) == 1 and isinstance(messages[0], Mapping):
        return completion_text(messages[0])
    lines = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise RewardError(f"judge: a chat prompt must be a list of message dicts, got {m!r:.80}")
        lines.append(f"{m.get('role', 'user')}: {completion_text(m)}")
    return "\n".join(lines)


_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_WORD = re.compile(r"[^a-z0-9]*([a-z]+)")


def parse_reply(text: str, parse: str, lo: float, hi: float) -> float:
    """The reward in a judge's reply; ValueError (the reason) when it has none."""
    if parse == "yes_no":
        m = _WORD.match(text.lower())
        word = m.group(1) if m else ""
        if word in ("yes", "no"):
            return 1.0 if word == "yes" else 0.0
        raise ValueError("it does not start with yes or no")
    m = _NUMBER.search(text)
    if not m:
        raise ValueError("it has no number")
    x = float(m.group(0))
    if not lo <= x <= hi:
        raise ValueError(f"its score {m.group(0)} is outside [{lo:g}, {hi:g}]")
    return (x - lo) / (hi - lo)


def _snippet(text: str) -> str:
    return repr(text[:_PREVIEW]) + ("..." if len(text) > _PREVIEW else "")
