"""A loopback HTTP server for a folder of images: the bundled demo and the benchmarks.

It speaks HTTP/1.1 with keep-alive, so it is a fair stand-in for a real image host, and
it binds to a loopback address only.
"""

from __future__ import annotations

import csv
import functools
import ipaddress
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample"


class _QuietHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # As nginx's tcp_nodelay: without it, a keep-alive response whose headers and body go
    # out in two writes waits ~40 ms for the client's delayed ACK (Nagle's algorithm).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@contextmanager
def serve_directory(root: str | Path, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``root`` on ``host`` (a loopback address) and yield the base URL."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"serve_directory binds to loopback only, not {host}")
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    server.request_queue_size = 256
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def bundled_sample_table(base_url: str) -> pa.Table:
    """The bundled sample as an input table (url, caption) pointing at ``base_url``."""
    with open(SAMPLE_DIR / "captions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return pa.table({
        "url": [f"{base_url}/images/{r['filename']}" for r in rows],
        "caption": [r["caption"] for r in rows],
    })
