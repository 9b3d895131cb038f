"""A real HTTP server speaking the OpenAI chat-completions API, for the judge reward's tests and
benchmark (scripts/bench_judge.py): stdlib ThreadingHTTPServer on 127.0.0.1, a free port, in a
daemon thread.

    with JudgeServer(latency_s=0.2, reply=lambda request: "7") as server:
        ...  # reward.judge.base_url = server.url
        server.count, server.max_in_flight, server.auth_headers

What each chat request gets, in this order:
  1. the next entry of `plan` while there is one (each request takes one, in arrival order),
     then
  2. what `reply(request_json)` returns: a str (the reply's content) or a Fault.
A Fault is one of FAULTS:
  "429"         HTTP 429 with `Retry-After: <retry_after>`
  "500"         HTTP 500
  "404"         HTTP 404 (as for a model the server does not serve)
  "not_json"    HTTP 200 with a body that is not JSON
  "no_choices"  HTTP 200 with JSON without choices
  "hang"        no reply for `hang_s` seconds (longer than the client's timeout), then a 500
`fail_429=N` / `fail_500=N` are shorthands for a plan of N "429" (then N "500") entries.
Every chat request sleeps `latency_s` first. GET {url}/models answers a model list (the judge's
probe); any other GET a 404.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = ("429", "500", "404", "not_json", "no_choices", "hang")


class Fault(str):
    """A reply function's way to ask for a fault instead of content: return Fault("500")."""

    def __new__(cls, kind: str):
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULTS}")
        return super().__new__(cls, kind)


def _last_user_content(request: dict) -> str:
    return next((m["content"] for m in reversed(request["messages"]) if m["role"] == "user"), "")


class JudgeServer:
    def __init__(
        self,
        reply: Callable[[dict], str] | None = None,
        *,
        latency_s: float = 0.0,
        plan: list[str] | None = None,
        fail_429: int = 0,
        fail_500: int = 0,
        retry_after: str | None = "0",
        hang_s: float = 5.0,
    ):
        self.reply = reply or (lambda request: "7")
        self.latency_s = latency_s
        self.plan = [Fault("429")] * fail_429 + [Fault("500")] * fail_500 + [Fault(k) for k in plan or []]
        self.retry_after = retry_after
        self.hang_s = hang_s
        self.requests: list[dict] = []  # the chat requests' JSON bodies, in arrival order
        self.auth_headers: list[str | None] = []  # each chat request's Authorization header
        self.probes = 0  # GET requests (the judge's build-time check)
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle

    @property
    def port(self) -> int:
        assert self._server is not None, "the server is not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The base_url to give the judge."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def count(self) -> int:
        """Chat requests received."""
        with self._lock:
            return len(self.requests)

    def reset(self) -> None:
        """Forget the recorded requests (not the plan)."""
        with self._lock:
            self.requests.clear()
            self.auth_headers.clear()
            self.probes = 0
            self.max_in_flight = self.in_flight

    def start(self) -> JudgeServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self), bind_and_activate=False)
        server.daemon_threads = True
        server.request_queue_size = 128  # many clients connecting at once (the default is 5)
        server.allow_reuse_address = True
        server.server_bind()
        server.server_activate()
        self._server = server
        # A short poll: shutdown() waits for the serving loop to notice (0.5 s by default).
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="judge-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wakes the hanging requests
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> JudgeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- one request

    def _next(self, request: dict) -> str:
        with self._lock:
            if self.plan:
                return self.plan.pop(0)
        return self.reply(request)

    def _enter(self, request: dict | None, auth: str | None) -> None:
        with self._lock:
            if request is None:
                self.probes += 1
                return
            self.requests.append(request)
            self.auth_headers.append(auth)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def _handler(owner: JudgeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            owner._enter(None, None)
            if self.path.rstrip("/").endswith("/v1/models"):
                models = {"object": "list", "data": [{"id": "judge", "object": "model"}]}
                self._send(200, json.dumps(models).encode())
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                request = json.loads(raw)
            except ValueError:
                self._send(400, b'{"error": "bad JSON"}')
                return
            if not self.path.endswith("/chat/completions"):
                self._send(404, b'{"error": "not found"}')
                return
            owner._enter(request, self.headers.get("Authorization"))
            try:
                if owner.latency_s:
                    time.sleep(owner.latency_s)
                what = owner._next(request)
                if isinstance(what, Fault):
                    self._fault(str(what))
                else:
                    reply = {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "model": request.get("model"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": what},
                                "finish_reason": "stop",
                            }
                        ],
                    }
                    self._send(200, json.dumps(reply).encode())
            finally:
                owner._leave()

        def _fault(self, kind: str) -> None:
            if kind == "429":
                headers = {"Retry-After": owner.retry_after} if owner.retry_after is not None else {}
                self._send(429, b'{"error": {"message": "rate limited"}}', headers)
            elif kind == "500":
                self._send(500, b'{"error": {"message": "internal error"}}')
            elif kind == "404":
                self._send(404, b'{"error": {"message": "The model does not exist."}}')
            elif kind == "not_json":
                self._send(200, b"<html>Bad Gateway</html>")
            elif kind == "no_choices":
                self._send(200, b'{"object": "chat.completion", "choices": []}')
            else:  # hang: the reply never comes within the client's timeout
                owner._stop.wait(owner.hang_s)
                try:
                    self._send(500, b'{"error": {"message": "too late"}}')
                except OSError:
                    pass  # the client has gone

    return Handler


def echo(request: dict) -> str | Fault:
    """A reply function: the last user message as it is (a judge whose template is "{completion}"
    replies the completion), or Fault(kind) for a message "fault:<kind>"."""
    text = _last_user_content(request)
    return Fault(text[6:]) if text.startswith("fault:") else text
