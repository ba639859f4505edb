"""A keep-alive HTTP server on a loopback address, with routes that misbehave on purpose.

Tests import it as ``from loopback_server import LoopbackServer`` (pytest puts ``tests/`` on
``sys.path``). It binds only to 127.x addresses: tests never send traffic anywhere else.

Routes (``N``/``secs`` arguments are optional query parameters):

==============================  ============================================================
``/img/<name>``                 a file of the image directory (Content-Length, Content-Type)
``/chunked/<name>``             the same, with ``Transfer-Encoding: chunked``
``/status/<code>``              that status with a short text body
``/flaky/<id>?fail=N&name=``    500 for the first N (1) requests of ``id``, then the image
``/retry-after/<id>?secs=&date=``  429 with ``Retry-After: secs`` (1; an HTTP date when
                                ``date=1``) the first time, then the image
``/slow?interval=&size=``       headers, then one byte per ``interval`` (0.1 s)
``/stall?secs=``                waits ``secs`` (5) before the status line
``/truncated/<name>``           the first half of the file (honest Content-Length)
``/html``                       a small HTML page
``/big?size=&chunked=1``        ``size`` (``big_size``) zero bytes, with Content-Length or
                                chunked
``/redirect-loop``              302 to itself
``/redirect-to?url=&code=``     302 (or ``code``) to any URL
``/redirect-chain/<n>``         302 to ``/redirect-chain/<n-1>``; ``/redirect-chain/0`` is
                                an image
``/robots/<value>/<name>``      the image with ``X-Robots-Tag: value``; ``|`` in the value
                                separates several headers
``/bomb.png``                   a 1-bit 20000x20000 PNG of a few KB (a decompression bomb)
``/hold/<name>?secs=``          holds the request ``secs`` (0.2) then the image; tracks
                                ``max_in_flight``
``/close-after/<name>``         the image, then the server closes the keep-alive connection
                                without saying so
``/connection-close/<name>``    the image with ``Connection: close``
``/reset``                      closes the connection without any response
``/garbage``                    bytes that are not HTTP
==============================  ============================================================
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import mimetypes
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.parse
import zlib
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pairforge.config import DownloadConfig

DEFAULT_IMAGES = {"red.jpg": ((64, 48), (220, 30, 30)),
                  "blue.png": ((32, 32), (20, 40, 200)),
                  "green.webp": ((40, 30), (20, 180, 60))}


def make_images(directory: Path) -> dict[str, Path]:
    """Write small real images (JPEG, PNG, WebP) into ``directory``; return name -> path."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (size, color) in DEFAULT_IMAGES.items():
        path = directory / name
        image = Image.new("RGB", size, color)
        for x in range(0, size[0], 4):  # some structure, so the codecs have work to do
            image.putpixel((x, x % size[1]), (255, 255, 255))
        image.save(path)
        paths[name] = path
    return paths


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


@functools.lru_cache(maxsize=4)
def make_bomb_png(side: int = 20000) -> bytes:
    """A valid 1-bit grayscale PNG of side x side zero pixels: tiny file, huge decode.

    Written by hand (not Pillow) so that building it never allocates the pixels.
    """
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    batch = row * 1000
    parts = [packer.compress(batch) for _ in range(side // 1000)]
    parts.append(packer.compress(row * (side % 1000)))
    parts.append(packer.flush())
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", b"".join(parts)) + _png_chunk(b"IEND", b""))


# Built once at import (~0.25 s of CPU; seconds on a loaded machine), not by the first
# request, whose fetch has a 1 s timeout in the tests.
make_bomb_png()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection serves many requests
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass

    def setup(self) -> None:
        super().setup()
        self.server.owner._connection_opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._connection_closed(self.connection)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        parts = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parts.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
        seen = dict(self.headers.items())
        seen[":version"] = self.request_version  # pseudo-header: the HTTP version used
        self.server.owner._record(path, seen)
        try:
            self.server.owner._route(self, path, query)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # helpers used by the routes

    def send_body(self, code: int, body: bytes, content_type: str = "application/octet-stream",
                  headers: list[tuple[str, str]] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers or []:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def send_chunked(self, body: bytes, content_type: str, chunk: int = 4096) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(body), chunk):
            piece = body[start:start + chunk]
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def redirect(self, location: str, code: int = 302) -> None:
        self.send_body(code, b"moved", "text/plain", [("Location", location)])


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    owner: LoopbackServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up (timeouts, byte caps, closed pools) are routine in these tests.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class LoopbackServer:
    """Start with ``with LoopbackServer(image_dir) as server:``; ``server.url("/img/x")``."""

    def __init__(self, image_dir: Path | None = None, host: str = "127.0.0.1", port: int = 0,
                 *, big_size: int = 2 * 1024 * 1024,
                 tls: ssl.SSLContext | None = None) -> None:
        if not host.startswith("127."):
            raise ValueError("the test server binds to loopback (127.x) addresses only")
        self.image_dir = Path(image_dir) if image_dir else None
        self.host = host
        self.big_size = big_size
        self.tls = tls  # a server-side context makes this an HTTPS server
        self._bind_port = port
        self._lock = threading.Lock()
        self._hits: Counter[str] = Counter()
        self._headers: defaultdict[str, list[dict[str, str]]] = defaultdict(list)
        self._open: set[socket.socket] = set()
        self.connections = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle

    def start(self) -> LoopbackServer:
        self._server = _Server((self.host, self._bind_port), _Handler)
        self._server.owner = self
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets = list(self._open)
        for sock in sockets:  # wake handler threads parked on idle keep-alive connections
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._server = None

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # addresses

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    # what the server saw

    @property
    def requests_seen(self) -> int:
        with self._lock:
            return sum(self._hits.values())

    def hits(self, path: str) -> int:
        """Requests received for ``path`` (without query string)."""
        with self._lock:
            return self._hits[path]

    def headers_seen(self, path: str) -> list[dict[str, str]]:
        """Request headers per request to ``path``, plus ``":version"`` (e.g. HTTP/1.1)."""
        with self._lock:
            return list(self._headers[path])

    def reset_counters(self) -> None:
        with self._lock:
            self._hits.clear()
            self._headers.clear()
            self.connections = 0
            self.max_in_flight = 0

    def _record(self, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self._hits[path] += 1
            self._headers[path].append(headers)

    def _connection_opened(self, sock: socket.socket) -> None:
        with self._lock:
            self.connections += 1
            self._open.add(sock)

    def _connection_closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    # routes

    def _image(self, name: str) -> tuple[bytes, str] | None:
        if self.image_dir is None or "/" in name or name.startswith("."):
            return None
        path = self.image_dir / name
        if not path.is_file():
            return None
        return path.read_bytes(), mimetypes.guess_type(name)[0] or "application/octet-stream"

    def _send_image(self, handler: _Handler, name: str,
                    headers: list[tuple[str, str]] | None = None) -> None:
        found = self._image(name)
        if found is None:
            handler.send_body(404, b"no such image", "text/plain")
        else:
            handler.send_body(200, found[0], found[1], headers)

    def _route(self, handler: _Handler, path: str, query: dict[str, str]) -> None:
        head, _, rest = path.lstrip("/").partition("/")
        route = getattr(self, "_route_" + head.replace("-", "_").replace(".", "_"), None)
        if route is None:
            handler.send_body(404, b"no such route", "text/plain")
        else:
            route(handler, rest, query)

    def _route_img(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        self._send_image(handler, rest)

    def _route_chunked(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        found = self._image(rest)
        if found is None:
            handler.send_body(404, b"no such image", "text/plain")
        else:
            handler.send_chunked(found[0], found[1], chunk=97)

    def _route_status(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        code = int(rest)
        handler.send_body(code, f"status {code}".encode(), "text/plain")

    def _first_image(self) -> str:
        return sorted(DEFAULT_IMAGES)[0]

    def _route_flaky(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        if self.hits(f"/flaky/{rest}") <= int(query.get("fail", 1)):
            handler.send_body(500, b"try again", "text/plain")
        else:
            self._send_image(handler, query.get("name", self._first_image()))

    def _route_retry_after(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        if self.hits(f"/retry-after/{rest}") > 1:
            self._send_image(handler, query.get("name", self._first_image()))
            return
        secs = float(query.get("secs", 1))
        if query.get("date") == "1":
            value = email.utils.formatdate(time.time() + secs, usegmt=True)
        else:
            value = str(int(secs))
        handler.send_body(429, b"slow down", "text/plain", [("Retry-After", value)])

    def _route_slow(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        interval = float(query.get("interval", 0.1))
        size = int(query.get("size", 100))
        handler.send_response(200)
        handler.send_header("Content-Type", "image/jpeg")
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        handler.wfile.flush()
        for _ in range(size):
            time.sleep(interval)
            handler.wfile.write(b"\xff")
            handler.wfile.flush()

    def _route_stall(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        time.sleep(float(query.get("secs", 5)))
        handler.send_body(200, b"late", "text/plain")

    def _route_truncated(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        found = self._image(rest)
        if found is None:
            handler.send_body(404, b"no such image", "text/plain")
        else:
            handler.send_body(200, found[0][: len(found[0]) // 2], found[1])

    def _route_html(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        page = b"<!doctype html><html><body><p>not an image</p></body></html>"
        handler.send_body(200, page, "text/html; charset=utf-8")

    def _route_big(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        body = bytes(int(query.get("size", self.big_size)))
        if query.get("chunked") == "1":
            handler.send_chunked(body, "image/jpeg", chunk=64 * 1024)
        else:
            handler.send_body(200, body, "image/jpeg")

    def _route_redirect_loop(self, handler: _Handler, rest: str,
                             query: dict[str, str]) -> None:
        handler.redirect("/redirect-loop")

    def _route_redirect_to(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        handler.redirect(query["url"], int(query.get("code", 302)))

    def _route_redirect_chain(self, handler: _Handler, rest: str,
                              query: dict[str, str]) -> None:
        left = int(rest)
        if left <= 0:
            self._send_image(handler, self._first_image())
        else:
            handler.redirect(f"/redirect-chain/{left - 1}")

    def _route_robots(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        value, _, name = rest.rpartition("/")
        self._send_image(handler, name, [("X-Robots-Tag", v) for v in value.split("|")])

    def _route_bomb_png(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        handler.send_body(200, make_bomb_png(), "image/png")

    def _route_hold(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(float(query.get("secs", 0.2)))
        finally:
            with self._lock:
                self.in_flight -= 1
        self._send_image(handler, rest)

    def _route_close_after(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        self._send_image(handler, rest)
        handler.wfile.flush()
        handler.close_connection = True  # no "Connection: close" header: the client is not told

    def _route_connection_close(self, handler: _Handler, rest: str,
                                query: dict[str, str]) -> None:
        self._send_image(handler, rest, [("Connection", "close")])

    def _route_reset(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        handler.close_connection = True

    def _route_garbage(self, handler: _Handler, rest: str, query: dict[str, str]) -> None:
        handler.wfile.write(b"\x00\x01 this is not HTTP\r\n\r\n")
        handler.close_connection = True


def pixel_count(png: bytes) -> int:
    """Width x height from a PNG header, without decoding (for asserting on the bomb)."""
    width, height = struct.unpack(">II", png[16:24])
    return width * height


def loopback_download_config(**overrides: Any) -> DownloadConfig:
    """A DownloadConfig for tests: only 127.0.0.1 allowed, short timeouts, fast retries."""
    values: dict[str, Any] = {"allow_addresses": ["127.0.0.1/32"], "timeout": 1.0,
                              "retries": 2, "backoff": 0.05, "max_retry_after": 5.0}
    values.update(overrides)
    return DownloadConfig(**values)
