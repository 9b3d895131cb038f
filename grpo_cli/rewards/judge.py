"""LLM-judge reward: a model served behind an OpenAI-compatible endpoint scores each completion.

One request per completion (``POST {base_url}/chat/completions`` with ``model``, ``messages``,
``max_tokens``, ``temperature``), all of a batch sent concurrently (at most ``concurrency`` at a
time) through one HTTP client that lives on the reward loop (rewards/aio.py) and is reused across
steps. The judge's reply is read by ``parse``:

``number`` (default)
    the first number in the reply (``"7"``, ``"Score: 7/10"``), which must lie in
    ``[min_score, max_score]``; the reward is ``(x - min_score) / (max_score - min_score)``, in [0, 1].
``yes_no``
    the reply's first word (case-insensitive, leading punctuation, spaces and markdown ignored):
    ``yes`` -> 1.0, ``no`` -> 0.0.

A reply that does not parse is a failure, as is a call that still fails after ``retries``
retries (HTTP 429 and 5xx, timeouts and connection errors are retried with exponential backoff
from ``backoff_s``, honouring a Retry-After header up to RETRY_AFTER_CAP_S). ``on_error`` says what
a failure does: ``raise`` (a RewardError naming the judge, its URL, what happened and the
completion) or ``nan`` (that completion scores NaN: the engine leaves its group out of the loss and
counts it in rewards/<name>/failures).

The judge's prompt is ``template`` (Python ``str.format``) with the fields ``{prompt}``,
``{completion}``, ``{min_score}``, ``{max_score}`` and any dataset column (``{answer}``); null
means TEMPLATES[parse]. The prompt is rendered as text: a string as it is; chat messages without
their system messages (the policy's instructions, not the question), then the one message left as
its content, or several as ``role: content`` lines. The completion is its text
(rewards.completion_text: the assistant messages' contents). ``system`` is an optional system
message for the judge.

The API key is read from the environment variable named by ``api_key_env`` (sent as
``Authorization: Bearer ...``); it is never written in an error message, a log or a repr.
``httpx`` is imported only when a judge is built (this module loads with the reward registry).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import os
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import aio
from ._common import RewardError, completion_text, raise_problems

# The options, their check, the template and the reply's parse live in rewards/_judge_options.py;
# re-imported here, where the reward, tests and other modules import them from.
from ._judge_options import (  # noqa: F401
    _D,
    _NUMBER,
    _PREVIEW,
    _WORD,
    ON_ERROR,
    OPTIONS,
    OWN_FIELDS,
    PARSES,
    TEMPLATES,
    Options,
    _snippet,
    _template,
    _template_fields,
    _template_problem,
    check_options,
    columns,
    parse_reply,
    render_prompt,
)
from .base import Reward

#: A server's Retry-After is honoured up to this many seconds.
RETRY_AFTER_CAP_S = 30.0
#: The build's check that the server answers waits at most this long (or timeout_s if shorter).
PROBE_TIMEOUT_S = 5.0


ROLE = "shaping"


class _Failure(Exception):
    """One completion that got no score: what happened, said for the user."""


# --------------------------------------------------------------------------
# the scorer
# --------------------------------------------------------------------------


class JudgeScorer:
    """What `build` makes: `await scorer(completions, prompts=..., **columns)` -> one float per
    completion (NaN for a failure under on_error=nan); `pop_metrics()` -> the counters since its
    last call: calls (completions sent), retries (re-sends), timeouts (calls that timed out) and
    failures (completions left without a score)."""

    def __init__(self, options: Mapping[str, Any], api_key: str | None):
        self.options = {name: options.get(name, getattr(_D, name)) for name in OPTIONS}
        self.base_url = self.options["base_url"].strip().rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.template = _template(self.options)
        self.fields = _template_fields(self.template)
        self._key = api_key
        self._client = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("calls", "retries", "timeouts", "failures"), 0)

    def __repr__(self) -> str:
        return f"JudgeScorer(model={self.options['model']!r}, url={self.url!r})"

    # -- counters

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def pop_metrics(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts

    # -- the client, one per loop (the reward loop's lives across steps)

    def _ensure_client(self):
        import httpx

        running = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not running:
            n = self.options["concurrency"]
            headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
            self._client = httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(self.options["timeout_s"]),
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            )
            self._client_loop = running
            self._semaphore = asyncio.Semaphore(n)
        return self._client

    def close(self) -> None:
        """Close the HTTP client (on the loop it was made on); a no-op if nothing was sent."""
        client, loop = self._client, self._client_loop
        self._client = self._client_loop = self._semaphore = None
        if client is None or loop is None or loop.is_closed():
            return
        if loop is aio.loop():
            aio.run(client.aclose())
        elif not loop.is_running():
            loop.run_until_complete(client.aclose())

    # -- scoring

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def _messages(self, i: int, completion: Any, prompts: Any, kwargs: Mapping[str, Any]) -> list[dict]:
        values: dict[str, Any] = {
            "completion": completion_text(completion),
            "min_score": float(self.options["min_score"]),
            "max_score": float(self.options["max_score"]),
        }
        if "prompt" in self.fields:
            values["prompt"] = render_prompt(prompts[i])
        for name in self.fields:
            if name not in OWN_FIELDS:
                values[name] = kwargs[name][i]
        messages = [{"role": "system", "content": self.options["system"]}] if self.options["system"] else []
        messages.append({"role": "user", "content": self.template.format(**values)})
        return messages

    def _check_inputs(self, n: int, prompts: Any, kwargs: Mapping[str, Any]) -> None:
        if "prompt" in self.fields and (prompts is None or len(prompts) != n):
            got = (
                "no prompts were passed"
                if prompts is None
                else f"{len(prompts)} prompts came for {n} completions"
            )
            raise RewardError(f"judge: its template uses {{prompt}}, but {got}")
        for name in self.fields:
            if name in OWN_FIELDS:
                continue
            values = kwargs.get(name)
            if values is None:
                present = sorted(k for k in kwargs if k not in OPTIONS and k != "completion_ids")
                raise RewardError(
                    f"judge: its template uses {{{name}}}, but no dataset column {name!r} was passed "
                    f"(columns present: {', '.join(present) or 'none'}); fix reward.judge.template or the data"
                )
            if len(values) != n:
                raise RewardError(f"judge: column {name!r} has {len(values)} values for {n} completions")

    async def _post(self, body: dict) -> str:
        """One call, retried; the reply's content, or _Failure."""
        import httpx

        client = self._ensure_client()
        retries, timeout = self.options["retries"], float(self.options["timeout_s"])
        attempt = 0
        while True:
            retry_after = None
            async with self._semaphore:
                try:
                    response = await asyncio.wait_for(client.post(self.url, json=body), timeout)
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    self._count("timeouts")
                    what = f"no reply within timeout_s={timeout:g} s"
                except httpx.TransportError as exc:
                    what = f"the connection failed ({type(exc).__name__}: {exc})"
                else:
                    status = response.status_code
                    if status == 200:
                        return self._content(response)
                    what = f"HTTP {status} (body: {_snippet(response.text)})"
                    if status != 429 and status < 500:
                        hint = {
                            401: "; check the key in api_key_env",
                            403: "; check the key in api_key_env",
                            404: "; check base_url (it should end in /v1) and model",
                        }.get(status, "")
                        raise _Failure(what + hint)
                    retry_after = _retry_after(response.headers.get("retry-after"))
            if attempt >= retries:
                raise _Failure(what + (f" after {retries} retries" if retries else " (retries=0)"))
            attempt += 1
            self._count("retries")
            delay = float(self.options["backoff_s"]) * 2 ** (attempt - 1) * (1 + 0.1 * random.random())
            await asyncio.sleep(min(retry_after, RETRY_AFTER_CAP_S) if retry_after is not None else delay)

    def _content(self, response) -> str:
        try:
            data = response.json()
        except ValueError:
            raise _Failure(f"the reply is not JSON: {_snippet(response.text)}") from None
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise _Failure(f"the reply has no choices[0].message.content: {_snippet(response.text)}")
        return content

    async def _one(self, i: int, n: int, messages: list[dict]) -> float:
        o = self.options
        body = {
            "model": o["model"],
            "messages": messages,
            "max_tokens": o["max_tokens"],
            "temperature": o["temperature"],
        }
        self._count("calls")
        try:
            content = await self._post(body)
            try:
                return parse_reply(content, o["parse"], float(o["min_score"]), float(o["max_score"]))
            except ValueError as exc:
                raise _Failure(
                    f"its reply does not parse as {o['parse']} ({exc}): {_snippet(content)}"
                ) from None
        except _Failure as failure:
            self._count("failures")
            if o["on_error"] == "nan":
                return math.nan
            raise RewardError(
                self._redact(
                    f"judge: the judge at {self.url} (model {o['model']!r}) gave no score for completion "
                    f"index {i} of {n}: {failure}. Check that the server is up and serves that model, raise "
                    "reward.judge.timeout_s (or retries) if it is slow, or set reward.judge.on_error=nan to "
                    "score such completions NaN (their group is left out of the loss and counted in "
                    "rewards/judge/failures)."
                )
            ) from None

    async def __call__(self, completions: list, prompts: list | None = None, **kwargs: Any) -> list[float]:
        n = len(completions)
        self._check_inputs(n, prompts, kwargs)
        requests = [self._messages(i, c, prompts, kwargs) for i, c in enumerate(completions)]
        tasks = [asyncio.ensure_future(self._one(i, n, m)) for i, m in enumerate(requests)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # the first failure raises: the calls still out are not waited for
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def _retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (delta-seconds or an HTTP date), None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# --------------------------------------------------------------------------
# lifecycle
# --------------------------------------------------------------------------


def build(device: Any, dist: Any, dtype: Any = None, **options: Any) -> JudgeScorer:
    """The judge's scorer, once its options are checked, its API key found and its server answers
    (device, dist and dtype, the run's, are not used: the judge is a server)."""
    raise_problems("judge", check_options(options))
    key_env = options.get("api_key_env")
    key = None
    if key_env:
        key = os.environ.get(key_env)
        if not key:
            raise RewardError(
                f"judge: reward.judge.api_key_env names the environment variable {key_env!r}, which is "
                f"{'empty' if key == '' else 'not set'}; export {key_env}=<your key> before the run, or "
                "set reward.judge.api_key_env=null for a server without a key"
            )
    scorer = JudgeScorer(options, key)
    _probe(scorer)
    return scorer


def _probe(scorer: JudgeScorer) -> None:
    """Raise unless something answers HTTP at the judge's URL (any status counts)."""
    import httpx

    url = f"{scorer.base_url}/models"
    timeout = min(PROBE_TIMEOUT_S, float(scorer.options["timeout_s"]))
    headers = {"Authorization": f"Bearer {scorer._key}"} if scorer._key else {}
    try:
        httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        what = (
            f"no reply within {timeout:g} s"
            if isinstance(exc, httpx.TimeoutException)
            else f"{type(exc).__name__}: {exc}"
        )
        raise RewardError(
            scorer._redact(
                f"judge: the judge at {scorer.base_url} does not answer (GET {url}: {what}); start the "
                "server or fix reward.judge.base_url"
            )
        ) from None


def close(scorer: JudgeScorer) -> None:
    scorer.close()


REWARD = Reward(
    name="judge",
    build=build,
    close=close,
    options=Options,
    check=check_options,
    role=ROLE,
    nan_ok=True,
    columns=columns,
)
