"""Accuracy reward: 1.0 when the completion's final answer equals the gold
answer, else 0.0 (``None`` for rows whose gold answer is ``None``).

Comparison uses HF math-verify (``parse`` + ``verify``): integers, decimals,
fractions, percentages, LaTeX and ``\\boxed{}`` are compared by value, so
``47.0`` matches ``47``, ``\\frac{3}{4}`` matches ``0.75`` and ``1,234``
matches ``1234``; ``470`` never matches ``47`` and ``-5`` never matches ``5``.

Extraction modes (option ``extract``):

``auto``
    math-verify's default extraction (LaTeX incl. ``\\boxed{}``, then plain
    expressions/numbers; "final answer is" / "answer" anchors first).
``boxed``
    the last ``\\boxed{...}`` only; no box -> 0.
``last_number``
    the last plain number in the text (sign, thousands separators, decimals,
    ``a/b``).
``answer_tag``
    the content of the last ``<answer>...</answer>``; no tag -> 0.
``gsm8k``
    the text after the last ``####`` on its line; none -> 0.

Gold answers are parsed the same way in every mode; a GSM8K-style gold
(``"... #### 72"``) is reduced to the text after ``####``.

Strict mode (``strict=True``, the default; ref 004 reward hacking): a
completion that states several *different* final-answer candidates scores 0,
so appending or listing numbers cannot farm reward ("47 or 48", "The answer is
12. 13. 14"). Repeating the same answer ("47. So the answer is 47") is fine.
The candidates are, for ``boxed`` / ``answer_tag`` / ``gsm8k``, every box / tag
/ ``####`` line; for ``auto`` / ``last_number``, every explicit answer
statement (boxes, ``<answer>`` tags, ``####`` lines, and the text after each
"answer is" / "answer:" / "答案是" up to the next one; without such a
statement, the text after the last mention of "answer"), or the whole
completion when none of those states a value.
Inside those regions every math span (``$...$``, ``\\(...\\)``, ``\\[...\\]``,
``\\frac``...) and every *standalone* plain number is a candidate; operands of
arithmetic (``12`` and ``35`` in ``12 + 35 = 47``) and math spans without
digits (``$x$``) are not. The reward is 1.0 only if the extracted answer
matches gold *and* every candidate matches gold. Consequence: a completion
with reasoning but no answer anchor ("Adding 12 and 35 gives 47") scores 0
under strict; prompt for an explicit answer (``\\boxed{}``, "The answer is",
``####``, ``<answer>``) or set ``strict: false``. In ``last_number`` mode the
last number must also be standalone (not the operand of ``12 - 13 - 14``).
Comma decimals ("1,5") and space thousands separators ("1 234") are read as
two numbers by the strict check.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Optional  # (Optional/List: OmegaConf reads Options' types)

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from ._common import (
    NUMBER_RE,
    RewardError,
    check_bool,
    check_choice,
    check_int,
    check_unknown,
    completion_text,
    iter_numbers,
    raise_problems,
)
from .base import Reward

EXTRACT_MODES = ("auto", "boxed", "last_number", "answer_tag", "gsm8k")


@dataclass(frozen=True)
class Options:
    """accuracy's options (reward.accuracy.<option>): the one place their defaults live."""

    answer_column: str = "answer"  # the dataset column holding each prompt's gold answer
    extract: str = "auto"  # EXTRACT_MODES: how the completion's final answer is found
    strict: bool = True  # several different final answers score 0 (ref 004 reward hacking)
    timeout_s: Optional[int] = 5  # math-verify's per-call timeout (main thread only); null: none


# correctness: this reward says whether a completion is right; it drives eval/accuracy, the pass
# rule (pass@k, pass_rate_hist) and the check that the data has its answer column.
ROLE = "correctness"
OPTIONS = tuple(f.name for f in fields(Options))
_D = Options()

_LATEX = (LatexExtractionConfig(),)
_EXPR = (ExprExtractionConfig(),)
_DEFAULT = (LatexExtractionConfig(), ExprExtractionConfig())
_CACHE_MAX_CHARS = 256


def check_options(options: Mapping[str, Any], *, unknown: bool = True) -> list[str]:
    """Problems with accuracy's options (``unknown``: also flag unknown keys)."""
    problems: list[str] = []
    if unknown:
        check_unknown(problems, options, OPTIONS)
    column = options.get("answer_column", _D.answer_column)
    if not isinstance(column, str) or not column:
        problems.append(f"option answer_column must be a column name, got {column!r}")
    check_choice(problems, "extract", options.get("extract", _D.extract), EXTRACT_MODES)
    check_bool(problems, "strict", options.get("strict", _D.strict))
    check_int(problems, "timeout_s", options.get("timeout_s", _D.timeout_s), minimum=1, allow_none=True)
    return problems


# --------------------------------------------------------------------------
# math-verify wrappers
# --------------------------------------------------------------------------


def _timeout(timeout_s: int | None) -> int | None:
    # math-verify's timeout is signal.alarm(): it only works in the main thread
    # and raises ValueError elsewhere, so it is switched off in other threads.
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return None
    return timeout_s


def _normalize(text: str) -> str:
    # math-verify only reads a bare number after whitespace, "=" or start of text:
    # "答案是47" gives nothing. Put a space between non-ASCII text and a number.
    text = text.replace("\u2212", "-")
    return re.sub(r"(?<=[^\x00-\x7f])(?=-?[0-9])", " ", text)


def _parse_uncached(kind: str, s: str, timeout: int | None) -> tuple:
    if kind == "text":
        result = parse(_normalize(s), list(_DEFAULT), parsing_timeout=timeout)
    elif kind == "number":
        result = parse(s.replace(",", ""), list(_EXPR), parsing_timeout=timeout)
    elif kind == "latex":
        result = parse(f"${s}$", list(_LATEX), parsing_timeout=timeout)
    elif kind == "boxed":
        result = parse(f"\\boxed{{{s}}}", list(_LATEX), parsing_timeout=timeout)
    elif kind == "gold":
        result = _parse_gold(s, timeout)
    else:  # pragma: no cover - internal misuse
        raise AssertionError(kind)
    return tuple(result)


_parse_cached = lru_cache(maxsize=8192)(_parse_uncached)


def _parse(kind: str, s: str, timeout: int | None) -> tuple:
    if len(s) > _CACHE_MAX_CHARS:
        return _parse_uncached(kind, s, timeout)
    return _parse_cached(kind, s, timeout)


_PLAIN_NUMBER_RE = re.compile(rf"-?{NUMBER_RE.pattern}")


def _gold_text(gold: Any) -> str:
    """The gold answer as text; a GSM8K solution ("... #### 72") becomes "72"."""
    g = str(gold)
    return (g.rsplit("####", 1)[1] if "####" in g else g).strip()


def _parse_gold(gold: str, timeout: int | None) -> list:
    g = _normalize(_gold_text(gold)).strip()
    if not g:
        return []
    if _PLAIN_NUMBER_RE.fullmatch(g):
        return parse(g.replace(",", ""), list(_EXPR), parsing_timeout=timeout)
    if "$" in g or "\\boxed" in g or "\\(" in g or "\\[" in g:
        return parse(g, list(_DEFAULT), parsing_timeout=timeout)
    if "\\" in g or re.search(r"[()\[\]{}^_=<>,]", g):
        # LaTeX or structured math ("(1, 2)", "x^2+1", "x = 3"): the expression
        # extractor would only take its last number.
        parsed = parse(f"${g}$", list(_LATEX), parsing_timeout=timeout)
        if parsed:
            return parsed
    # Plain words ("n/a", "B") are not parsed as LaTeX (they would become
    # products of symbols): they stay unparsed and are reported.
    return parse(g, list(_EXPR), parsing_timeout=timeout)


def _has_expr(parsed: tuple) -> bool:
    return any(not isinstance(p, str) for p in parsed)


def _matches(gold: tuple, kind: str, s: str, timeout: int | None) -> bool:
    pred = _parse(kind, s, timeout)
    if not pred:
        return False
    return bool(verify(list(gold), list(pred), timeout_seconds=timeout))


# --------------------------------------------------------------------------
# locating answers
# --------------------------------------------------------------------------


def _boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of each top-level \\boxed{...} / \\fbox{...}."""
    spans = []
    pos = 0
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        if m.start() < pos:
            continue  # nested inside the previous box
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            spans.append((m.start(), i, text[m.end() : i - 1]))
            pos = i
    return spans


_MATH_SPAN_RE = re.compile(
    r"\$\$(?P<a>.+?)\$\$|\\\[(?P<b>.+?)\\\]|\\\((?P<c>.+?)\\\)|(?<![\\$])\$(?P<d>[^$\n]+?)\$",
    re.DOTALL,
)
# Bare LaTeX numbers outside math delimiters: \frac{3}{4}, 2\sqrt{3}, 3\pi.
_BARE_LATEX_RE = re.compile(
    r"-?(?:[0-9.]+\s*)?\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
    r"|-?[0-9.]*\s*\\sqrt\s*(?:\[[^\]]*\])?\s*\{[^{}]*\}"
    r"|-?[0-9.]*\s*\\pi\b"
)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is 47", "Answer: 47", "答案是47": an answer *statement*.
_STATEMENT_RE = re.compile(
    r"(?i:\banswer\b(?:\*\*)?\s*(?:is\b|was\b|would\s+be\b|should\s+be\b|[:=\uff1a]))"
    r"|答案\s*(?:是|为|[:=\uff1a])"
)
# Any mention of the answer ("... so that is my answer.").
_ANCHOR_RE = re.compile(r"(?i:\banswer\b)|答案")
# An unevaluated computation between numbers ("13 - 1", "4 * 4", "9 \\times 3"): math-verify
# would evaluate it and call it equal to the gold, so a policy learns to restate the question
# as an expression instead of answering it (seen in training: "What is 13 minus 1?" -> "13 - 1").
# A fraction a/b is a value, not a computation, and stays allowed.
_UNEVALUATED_RE = re.compile(r"\d\s*(?:[-+*×·÷^]|\\times|\\cdot|\\div)\s*[-(]?\s*\d")
_BLANK = " ; "


def _blank(text: str, spans: list[tuple[int, int]]) -> str:
    out, pos = [], 0
    for start, end in spans:
        out.append(text[pos:start])
        out.append(_BLANK)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _candidates(region: str) -> list[tuple[str, str]]:
    """Answer candidates stated in a piece of text, as (kind, string)."""
    found: list[tuple[str, str]] = []
    boxed = _boxed_spans(region)
    found += [("boxed", c) for _, _, c in boxed]
    region = _blank(region, [(s, e) for s, e, _ in boxed])
    spans = []
    for m in _MATH_SPAN_RE.finditer(region):
        found.append(("latex", next(g for g in m.groups() if g is not None)))
        spans.append(m.span())
    region = _blank(region, spans)
    spans = []
    for m in _BARE_LATEX_RE.finditer(region):
        found.append(("latex", m.group(0)))
        spans.append(m.span())
    region = _blank(region, spans)
    # A math span without digits ($x$) names a variable; it states no answer.
    found = [(k, s) for k, s in found if re.search(r"[0-9]", s)]
    found += [("number", lit) for _, _, lit, standalone in iter_numbers(region) if standalone]
    return found


def _answer_regions_candidates(text: str) -> list[tuple[str, str]]:
    """Candidates of every explicit answer statement, else of the whole text."""
    found: list[tuple[str, str]] = []
    boxed = _boxed_spans(text)
    found += [("boxed", c) for _, _, c in boxed]
    rest = _blank(text, [(s, e) for s, e, _ in boxed])
    for regex in (_ANSWER_TAG_RE, _GSM8K_RE):
        matches = list(regex.finditer(rest))
        for m in matches:
            found += _candidates(m.group(1))
        rest = _blank(rest, [m.span() for m in matches])
    statements = list(_STATEMENT_RE.finditer(rest))
    if statements:
        # Every answer statement counts ("answer: 47; answer: 48" states two).
        ends = [m.start() for m in statements[1:]] + [len(rest)]
        for m, end in zip(statements, ends):
            found += _candidates(rest[m.end() : end])
    else:
        anchors = list(_ANCHOR_RE.finditer(rest))
        if anchors:
            found += _candidates(rest[anchors[-1].end() :])
    if not found:
        # No explicit answer statement (or one that states nothing, as in
        # "47 or 48. That's my answer"): every value in the text is a candidate.
        found = _candidates(text)
    return found


def _score_one(text: str, gold: tuple, extract: str, strict: bool, timeout: int | None) -> float:
    candidates: list[tuple[str, str]]
    if extract == "auto":
        pick = ("text", text)
        candidates = _answer_regions_candidates(text) if strict else []
    elif extract == "boxed":
        contents = [c for _, _, c in _boxed_spans(text)]
        if not contents:
            return 0.0
        pick = ("boxed", contents[-1])
        candidates = [("boxed", c) for c in contents]
    elif extract in ("answer_tag", "gsm8k"):
        # <answer>...</answer> or "#### ...": the last one is the answer; strict checks them all.
        contents = (_ANSWER_TAG_RE if extract == "answer_tag" else _GSM8K_RE).findall(text)
        if not contents:
            return 0.0
        pick = ("text", contents[-1])
        candidates = [c for content in contents for c in _candidates(content)] if strict else []
    else:  # last_number
        numbers = list(iter_numbers(text))
        if not numbers:
            return 0.0
        _, _, literal, standalone = numbers[-1]
        if strict and not standalone:
            return 0.0  # "12 - 13 - 14": the last number is an operand, not an answer
        pick = ("number", literal)
        candidates = _answer_regions_candidates(text) if strict else []
    if strict:
        if extract == "auto" and not candidates:
            return 0.0  # no value is stated: "13 - 1" restates the question as an expression
        if pick[0] != "number" and _UNEVALUATED_RE.search(pick[1]) and extract != "auto":
            return 0.0  # "\\boxed{13-1}": the stated answer is a computation, not a value
    if not _matches(gold, *pick, timeout):
        return 0.0
    if strict:
        for kind, s in dict.fromkeys(candidates):  # dedupe, keep order
            if kind in ("latex", "boxed") and not _has_expr(_parse(kind, s, timeout)):
                continue  # unparseable LaTeX cannot be judged; the pick already matched
            if not _matches(gold, kind, s, timeout):
                return 0.0
    return 1.0


def accuracy(
    completions: list,
    answer: list | None = None,
    *,
    answer_column: str = _D.answer_column,
    extract: str = _D.extract,
    strict: bool = _D.strict,
    timeout_s: int | None = _D.timeout_s,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold answer, else 0.0.

    ``kwargs[answer_column]`` (or ``answer``) holds the gold answers, one per
    completion; a ``None`` gold gives ``None`` (not applicable). A gold answer
    that math-verify cannot parse raises :class:`RewardError`. ``timeout_s`` is
    math-verify's per-call timeout (signal based, so it is only used in the
    main thread; ``null`` disables it).
    """
    raise_problems(
        "accuracy",
        check_options(
            {"answer_column": answer_column, "extract": extract, "strict": strict, "timeout_s": timeout_s},
            unknown=False,
        ),
    )
    golds = answer if answer_column == "answer" else kwargs.get(answer_column)
    if golds is None:
        present = sorted(k for k in kwargs if k not in ("prompts", "completion_ids", "completions"))
        if answer is not None:
            present = sorted(present + ["answer"])
        raise RewardError(
            f"accuracy: the gold-answer column {answer_column!r} was not passed to the reward; "
            f"columns present: {', '.join(present) or '(none)'}. Set reward.accuracy.answer_column "
            "to the dataset column that holds the reference answer."
        )
    if len(golds) != len(completions):
        raise RewardError(
            f"accuracy: column {answer_column!r} has {len(golds)} values for {len(completions)} completions"
        )
    timeout = _timeout(timeout_s)
    rewards: list[float | None] = []
    for i, (completion, gold) in enumerate(zip(completions, golds)):
        if gold is None:
            rewards.append(None)
            continue
        gold_parsed = _parse("gold", _gold_text(gold), timeout)
        if not gold_parsed:
            raise RewardError(
                f"accuracy: cannot parse the gold answer {str(gold)!r:.120} (column {answer_column!r}, "
                f"row {i}); math-verify found no number or expression in it. Fix the dataset or choose "
                "another answer_column."
            )
        text = completion_text(completion)
        rewards.append(_score_one(text, gold_parsed, extract, strict, timeout) if text.strip() else 0.0)
    return rewards


def check_rows(rows: list[dict], options: Mapping[str, Any]) -> list[str]:
    """The data's gold answers that hold no number or expression (words, True/False, lists of
    words): this reward cannot score them, and would stop the run at the first one it meets."""
    column = options.get("answer_column", Options.answer_column)
    timeout = _timeout(options.get("timeout_s", Options.timeout_s))
    golds = [row.get(column) for row in rows if row.get(column) is not None]
    # (a gold with a digit parses; math-verify is asked only about the others)
    text = [
        g for g in golds if not re.search(r"\d", _gold_text(g)) and not _parse("gold", _gold_text(g), timeout)
    ]
    if not text:
        return []
    examples = ", ".join(repr(str(g)[:30]) for g in text[:3])
    return [
        f"reward.accuracy compares numbers and math expressions (math-verify), but {len(text)} of the "
        f"data's {len(golds)} gold answers in column {column!r} hold none ({examples}): it cannot score "
        "them. A task with answers in words needs its own scorer: reward=[reasoning_gym] for "
        "data=reasoning_gym, or a reward function of yours that compares text "
        "(reward=[] +reward.mine.fn=my_module:my_reward; docs/rewards.md)."
    ]


REWARD = Reward(
    name="accuracy", fn=accuracy, options=Options, check=check_options, role=ROLE, check_rows=check_rows
)
