"""A small OpenAI-compatible server on 127.0.0.1, for the captioning tests.

``GET /v1/models`` lists ``models`` (what the preflight of the captioning server asks), or
answers ``status`` without a list. ``POST /v1/chat/completions`` answers with the real
generations of a transformers captioner (pairforge.recaption.backends.TransformersCaptioner)
for a served model, the way vLLM or SGLang would serve it: the image arrives as a base64
data URL, the prompt as text, or with ``text`` for every image when no captioner is
given. The first ``fail_first`` completions get a 503 with ``Retry-After: 0`` so the
client's retries run; ``answer_status`` answers every completion with that status (and
``Retry-After: 0``), ``garbage`` with a 200 whose body is not a chat completion.
``hold_until``: each completion waits until that many are in flight at once (at most
``hold_s``), so a client that never reaches that many waits ``hold_s`` per request and
``max_in_flight`` says how many it reached. ``closed_port`` is a port where nothing
listens.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from PIL import Image

from pairforge.recaption.backends import Captioner


def _image(body: dict[str, Any]) -> Image.Image:
    """The image a chat completion request carries (a data URL)."""
    content = body["messages"][-1]["content"]
    url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class OpenAIServer:
    def __init__(self, models: list[str], captioner: Captioner | None = None, *,
                 status: int = 200, fail_first: int = 0, text: str | None = None,
                 answer_status: int | None = None, garbage: bool = False,
                 hold_until: int | None = None, hold_s: float = 10.0,
                 refuse: Callable[[Image.Image], bool] | None = None) -> None:
        self.models, self.captioner, self.text = models, captioner, text
        self.refuse = refuse  # images answered 500 (a server failing some requests)
        self.status, self.fail_first = status, fail_first
        self.answer_status, self.garbage = answer_status, garbage
        self.hold_until, self.hold_s = hold_until, hold_s
        self.requests: list[tuple[str, str | None]] = []  # ("GET /v1/models", Authorization)
        self.completions = 0  # POSTs to /v1/chat/completions, failed ones included
        self.prompts: Counter[str] = Counter()
        self.logit_biases: list[dict[str, int] | None] = []  # as each completion carried it
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._reached = threading.Event()  # hold_until requests were in flight at once
        self._model_lock = threading.Lock()  # one generate at a time, like one GPU
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> OpenAIServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def list_models(self) -> tuple[int, dict[str, Any]]:
        if self.status != 200:
            return self.status, {"error": {"message": "no"}}
        return 200, {"object": "list",
                     "data": [{"id": m, "object": "model"} for m in self.models]}

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | bytes]:
        with self._lock:
            self.completions += 1
            if self.completions <= self.fail_first:
                return 503, {"error": {"message": "warming up"}}
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            if self.hold_until is not None and self._in_flight >= self.hold_until:
                self._reached.set()
        try:
            if self.hold_until is not None:
                self._reached.wait(self.hold_s)
            if self.answer_status is not None:
                return self.answer_status, {"error": {"message": "server error"}}
            if self.garbage:  # a proxy's error page with a 200
                return 200, b"<html><body>upstream hiccup</body></html>"
            if self.refuse is not None and self.refuse(_image(body)):
                return 500, {"error": {"message": "server error"}}
            return self._generate(body)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("model") in self.models and self.captioner is None and self.text:
            with self._lock:
                self.prompts[body["messages"][-1]["content"][-1]["text"]] += 1
            return 200, {"object": "chat.completion", "model": body["model"], "choices": [
                {"index": 0, "message": {"role": "assistant", "content": self.text}}]}
        if self.captioner is None or body.get("model") not in self.models:
            return 404, {"error": {"message": f"model {body.get('model')!r} not served"}}
        content = body["messages"][-1]["content"]
        prompt = next(c["text"] for c in content if c["type"] == "text")
        image = _image(body)
        with self._model_lock:
            self.prompts[prompt] += 1
            self.logit_biases.append(body.get("logit_bias"))
            text = self.captioner.generate([image], prompt)[0]
        return 200, {"object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}}]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(*(server.list_models() if self._seen("GET") == "/v1/models"
                               else (404, {"error": {"message": "not found"}})))

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._seen("POST") != "/v1/chat/completions":
                    self._answer(404, {"error": {"message": "not found"}})
                    return
                self._answer(*server.complete(body))

            def _seen(self, method: str) -> str:
                with server._lock:
                    server.requests.append((f"{method} {self.path}",
                                            self.headers.get("Authorization")))
                return self.path

            def _answer(self, status: int, reply: dict[str, Any] | bytes) -> None:
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 503 or status == server.answer_status:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

        return Handler


def closed_port() -> int:
    """A port on 127.0.0.1 that was just free: a connection there is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def closed_port_url() -> str:
    """A /v1 URL at ``closed_port()``."""
    return f"http://127.0.0.1:{closed_port()}/v1"
