"""Draining the service's HAProxy on a stop: no new connections, then wait for the
requests in flight, through HAProxy's admin socket (its documented runtime API).

``disable frontend`` is what HAProxy does in a soft stop: the frontend releases its port
(new connections are refused) while the connections it holds go on. The requests in flight
are those at a backend: its current sessions and its queue (``show stat``).
"""

from __future__ import annotations

import csv
import io
import socket
import time

FRONTEND = "http_frontend"  # Ray Serve's name for the HTTP listener
POLL_S = 0.1


def admin_command(path: str, command: str, timeout_s: float = 2.0) -> str:
    """One command on HAProxy's admin socket at ``path``, and its whole answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def in_flight(path: str) -> int:
    """Requests at HAProxy's backends: being answered (``scur``) or queued (``qcur``)."""
    table = admin_command(path, "show stat").lstrip("# ")
    return sum(int(row["scur"] or 0) + int(row["qcur"] or 0)
               for row in csv.DictReader(io.StringIO(table)) if row["svname"] == "BACKEND")


def drain(sockets: list[str], drain_s: float) -> float:
    """Stop each HAProxy taking connections, then wait up to ``drain_s`` for its requests
    in flight to be answered (none seen twice in a row); the seconds it took. A socket
    that does not answer (HAProxy already gone) counts as drained."""
    started = time.monotonic()
    live = []
    for path in sockets:
        try:
            admin_command(path, f"disable frontend {FRONTEND}")
            live.append(path)
        except OSError:
            continue
    idle_polls = 0
    while live and idle_polls < 2 and time.monotonic() - started < drain_s:
        try:
            busy = sum(in_flight(path) for path in live)
        except OSError:
            break
        idle_polls = idle_polls + 1 if busy == 0 else 0
        time.sleep(POLL_S)
    return time.monotonic() - started
