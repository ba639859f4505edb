"""The HAProxy configuration ``pairforge serve`` runs, made from the one Ray Serve writes.

Ray Serve 2.60 renders HAProxy's configuration from a fixed template
(``ray/serve/_private/haproxy_templates.py``) and has no setting for what the service needs
of it: the stats page (``bind *:PORT``) and Prometheus exporter (``bind :PORT``) listen on
every interface, the admin socket is ``mode 666 level admin``, and there is no ``timeout
http-request``, no per-source connection limit and no request buffering. Its environment
variables cover the paths, ports, ``maxconn`` and the client/server timeouts only. So a
local service's ``RAY_SERVE_HAPROXY_BINARY_PATH`` is a two-line script
(pipeline/ray_runtime.py) that runs this module before each HAProxy start or reload:
it rewrites the file named by ``-f`` with the settings in a JSON file (``serve.*``,
written by ``configure_front``) and then becomes the real HAProxy (``execv``: same pid,
same command line, which Ray's manager checks). It rewrites HAProxy's configuration
language, not Ray's Python, so a Ray upgrade that changes the template either still
matches or stops the start with a message naming what was not found (fail closed:
tests/test_serve_hostile.py renders the installed Ray's template through it).

Standard library only: it runs in a fresh interpreter on every HAProxy (re)start.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
from typing import Any

HTTP_FRONTEND = "frontend http_frontend"
LISTENERS = ("frontend prometheus", "listen stats")  # Ray's extra listening sections


class HookError(RuntimeError):
    """Ray's configuration no longer has what the rewrite relies on."""


def sections(text: str) -> list[list[str]]:
    """The configuration's sections (``global``, ``defaults``, ``frontend NAME``, ...),
    each its header line and the indented lines under it; blank and comment lines stay
    with the section they are in."""
    out: list[list[str]] = [[]]
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            out.append([])
        out[-1].append(line)
    return [s for s in out if s]


def _header(section: list[str]) -> str:
    return section[0].strip()


def _bind_on(section: list[str], host: str) -> list[str]:
    """``bind *:PORT`` / ``bind :PORT`` (every interface) made ``bind HOST:PORT``."""
    return [re.sub(r"^(\s*bind\s+)(\*|0\.0\.0\.0)?:(\d+)", rf"\g<1>{host}:\3", line)
            for line in section]


def _global(section: list[str], s: dict[str, Any]) -> list[str]:
    text = "\n".join(section)
    text, sockets = re.subn(r"(stats socket \S+) mode 6[06]{2} level admin",
                            r"\1 mode 600 level admin", text)
    if not sockets:
        raise HookError("no 'stats socket PATH mode 666 level admin' in the global section")
    text, caps = re.subn(r"(?m)^(\s*maxconn )\d+", rf"\g<1>{s['max_connections']}", text)
    if not caps:
        raise HookError("no maxconn in the global section")
    return text.split("\n")


# the defaults' timeouts Ray may write (empty or from its environment), replaced by ours
# (and ours, so that a file rewritten twice comes out the same)
_TIMEOUTS = re.compile(r"^\s*(timeout (client|server|http-request) |option http-buffer-request)")


def _defaults(section: list[str], s: dict[str, Any]) -> list[str]:
    kept = [line for line in section if not _TIMEOUTS.match(line)]
    # option http-buffer-request: HAProxy holds a request until its body (up to its 16 KB
    # buffer) is in, within timeout http-request, so a slow body never takes a replica slot
    return kept[:1] + [f"    timeout http-request {s['http_request_timeout_s']}s",
                       f"    timeout client {s['client_timeout_s']}s",
                       f"    timeout server {s['server_timeout_s']}s",
                       "    option http-buffer-request"] + kept[1:]


def _http_frontend(section: list[str], s: dict[str, Any]) -> list[str]:
    binds = [i for i, line in enumerate(section) if line.strip().startswith("bind ")]
    if any("track-sc0" in line for line in section):  # rewritten before
        return section
    if not binds:
        raise HookError(f"no bind line in {HTTP_FRONTEND}")
    # one client address may hold max_connections_per_source connections; more are closed
    # as they arrive, before HAProxy reads a byte, so one client cannot take the cap
    limit = [
        "    stick-table type ipv6 size 100k expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt "
        f"{s['max_connections_per_source']} }}"]
    at = binds[-1] + 1
    return section[:at] + limit + section[at:]


def harden(text: str, s: dict[str, Any]) -> str:
    """Ray's HAProxy configuration with the service's settings ``s`` applied."""
    out, seen = [], set()
    for section in sections(text):
        head = _header(section)
        seen.add(head)
        if head == "global":
            section = _global(section, s)
        elif head == "defaults":
            section = _defaults(section, s)
        elif head == HTTP_FRONTEND:
            section = _http_frontend(section, s)
        elif head in LISTENERS:
            if not s["stats_listeners"]:
                continue
            section = _bind_on(section, s["host"])
        out.extend(section)
    missing = {"global", "defaults", HTTP_FRONTEND} - seen
    if missing:
        raise HookError(f"no {', '.join(sorted(missing))} section")
    return "\n".join(out) + "\n"


def _config_path(args: list[str]) -> str:
    if "-f" not in args or args.index("-f") + 1 >= len(args):
        raise HookError("HAProxy was started without -f CONFIG")
    return args[args.index("-f") + 1]


def rewrite(path: str, settings: dict[str, Any]) -> None:
    """Rewrite the configuration at ``path`` in place, under the lock Ray writes it with."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(path) as f:
            text = harden(f.read(), settings)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def main(argv: list[str]) -> None:
    """``python -m pairforge.serve.haproxy_hook SETTINGS.json REAL_HAPROXY ARGS...``"""
    settings_path, binary, args = argv[0], argv[1], argv[2:]
    try:
        with open(settings_path) as f:
            settings = json.load(f)
        rewrite(_config_path(args), settings)
    except (OSError, ValueError, KeyError, HookError) as err:
        # fail closed: HAProxy as Ray wrote it would listen on every interface
        print(f"pairforge: HAProxy not started: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
