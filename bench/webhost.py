"""Loopback image hosts for the stage-1 benchmark: nginx when installed, else our server.

nginx (Debian's ``nginx-light``: ``apt-get install -y nginx-light``) is started from a
temporary config, in the foreground (``daemon off``) as a child of this process, with its
pid file, logs and temp paths in a temporary folder: no system service is touched. It runs
one worker with ``sendfile on; tcp_nodelay on;`` and nginx's keep-alive defaults, and
listens on 127.0.0.1 .. 127.0.0.N (every 127/8 address is the loopback interface on
Linux), so a URL list can spread over N hosts. When nginx is missing, the Python
``serve_directory`` (one per address, in one child process) stands in, and ``Hosts.server``
says which one served.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    sendfile on;
    tcp_nodelay on;
    types {{ image/jpeg jpg; }}
    default_type application/octet-stream;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
{listens}
        root {root};
    }}
}}
"""


@dataclass
class Hosts:
    server: str  # "nginx 1.22.1" or "serve_directory (Python)"
    base_urls: list[str]  # one per loopback host
    pids: list[int] = field(default_factory=list)  # the server's processes (for CPU and RSS)
    _stop: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for stop in reversed(self._stop):
            stop()
        self._stop.clear()


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def addresses(n_hosts: int) -> list[str]:
    if not 1 <= n_hosts <= 254:
        raise ValueError("between 1 and 254 loopback hosts")
    return [f"127.0.0.{i}" for i in range(1, n_hosts + 1)]


def _check_readable(root: Path) -> None:
    """nginx's worker runs as nobody when started by root: every folder up to the images
    must be world-traversable and the files world-readable."""
    for folder in [root, *root.parents]:
        if not os.stat(folder).st_mode & 0o001:
            raise PermissionError(f"{folder} is not traversable by nginx's worker; "
                                  "put the images under a world-readable folder")


def start_nginx(root: Path, n_hosts: int, binary: str) -> Hosts:
    _check_readable(root)
    tmp = Path(tempfile.mkdtemp(prefix="pairforge-nginx-"))
    port = free_port()
    listens = "\n".join(f"        listen {a}:{port};" for a in addresses(n_hosts))
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, listens=listens, root=root))
    version = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip()
    proc = subprocess.Popen([binary, "-p", str(tmp), "-c", str(tmp / "nginx.conf"),
                             "-e", str(tmp / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        proc.send_signal(signal.SIGQUIT)  # graceful: the master stops its worker
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    hosts = Hosts(f"nginx {version.split('/')[-1]}",
                  [f"http://{a}:{port}" for a in addresses(n_hosts)], _stop=[stop])
    try:
        _wait_listening(addresses(n_hosts), port, proc, tmp)
        hosts.pids = [proc.pid, *_children(proc.pid)]
    except BaseException:
        hosts.close()
        raise
    return hosts


def _wait_listening(hosts: list[str], port: int, proc: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + 10
    pending = list(hosts)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {(tmp / 'error.log').read_text()[-2000:]}")
        try:
            socket.create_connection((pending[0], port), timeout=1).close()
            pending.pop(0)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not listen on {pending[0]}:{port}") from None
            time.sleep(0.05)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _serve(root: str, hosts: list[str], queue: mp.Queue) -> None:
    from contextlib import ExitStack

    from pairforge.download.folder_server import serve_directory

    with ExitStack() as stack:
        queue.put([stack.enter_context(serve_directory(root, host)) for host in hosts])
        while True:
            time.sleep(3600)


def start_python_server(root: Path, n_hosts: int) -> Hosts:
    """The fallback: threaded HTTP/1.1 servers in one child process (its own GIL)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(str(root), addresses(n_hosts), queue),
                       daemon=True)
    proc.start()

    def stop() -> None:
        proc.terminate()
        proc.join(10)

    return Hosts("serve_directory (Python)", queue.get(timeout=60), [proc.pid], [stop])


def start_hosts(root: Path, n_hosts: int = 1, prefer: str = "nginx") -> Hosts:
    """nginx if asked and installed, else the Python server, on ``n_hosts`` addresses."""
    binary = nginx_binary() if prefer == "nginx" else None
    if binary:
        return start_nginx(root, n_hosts, binary)
    if prefer == "nginx":
        print("nginx not found (apt-get install -y nginx-light): using serve_directory")
    return start_python_server(root, n_hosts)
