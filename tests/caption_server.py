"""A small OpenAI-compatible chat-completions server on 127.0.0.1, for the recaption tests.

It answers ``POST /v1/chat/completions`` with the real generations of a transformers
captioner (pairforge.recaption.backends.TransformersCaptioner), the way vLLM or SGLang
would serve a model: the image arrives as a base64 data URL, the prompt as text. The
first ``fail_first`` requests get a 503 with ``Retry-After: 0`` so the client's retries run.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from PIL import Image

from pairforge.recaption.backends import Captioner


class CaptionServer:
    def __init__(self, captioner: Captioner, model_name: str, fail_first: int = 0) -> None:
        self.captioner, self.model_name, self.fail_first = captioner, model_name, fail_first
        self.requests = 0
        self.prompts: Counter[str] = Counter()
        self.logit_biases: list[dict[str, int] | None] = []  # as each request carried it
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()  # one generate at a time, like one GPU
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> CaptionServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("model") != self.model_name:
            return 404, {"error": {"message": f"model {body.get('model')!r} not served"}}
        content = body["messages"][-1]["content"]
        url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        prompt = next(c["text"] for c in content if c["type"] == "text")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
        with self._model_lock:
            self.prompts[prompt] += 1
            self.logit_biases.append(body.get("logit_bias"))
            text = self.captioner.generate([image], prompt)[0]
        return 200, {"object": "chat.completion", "model": self.model_name,
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}}]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests += 1
                    fail = server.requests <= server.fail_first
                    server._in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server._in_flight)
                try:
                    if self.path != "/v1/chat/completions":
                        status, reply = 404, {"error": {"message": "not found"}}
                    elif fail:
                        status, reply = 503, {"error": {"message": "warming up"}}
                    else:
                        status, reply = server.answer(body)
                finally:
                    with server._lock:
                        server._in_flight -= 1
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if fail:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

        return Handler
