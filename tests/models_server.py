"""The ``GET /v1/models`` answer of an OpenAI-compatible server, on 127.0.0.1 only, and a
port there where nothing listens: what the preflight of the captioning server asks."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ModelsServer:
    """Serves ``models`` at ``/v1/models`` (or answers ``status`` with no list)."""

    def __init__(self, models: list[str], status: int = 200) -> None:
        self.models, self.status, self.requests = models, status, []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ModelsServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.requests.append((self.path, self.headers.get("Authorization")))
                found = self.path == "/v1/models"
                status = server.status if found else 404
                body = {"object": "list", "data": [{"id": m, "object": "model"}
                                                   for m in server.models]}
                data = json.dumps(body if found and status == 200 else {"error": "no"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
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
