"""Nothing of ``pairforge serve`` or of a local Ray listens beyond loopback (issue 46:
"``ss -ltn`` shows nothing on 0.0.0.0 with the default config").

Every listening TCP socket of a process tree is found from /proc: the socket inodes in each
process's fd table, matched against /proc/net/tcp and /proc/net/tcp6. The service is the
real ``pairforge serve`` (its driver, Ray's GCS, raylet, agents and workers, Serve's
controller, proxy and replicas, HAProxy) with the default ``serve.host``; the local Ray a
build starts is ``init_ray`` in a subprocess, once as shipped and once with the
``loopback`` use switched off, which listens on every interface again (so the reading of
/proc can tell the two apart).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.e2e  # starts Ray and a Serve application

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "pairforge" / "sample"
LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp*


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket on this host."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            found[int(fields[9])] = (str(_address(address)), int(port, 16))
    return found


def _tree(root: int) -> dict[int, str]:
    """pid -> name of ``root`` and its descendants."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            parents[int(entry.name)], names[int(entry.name)] = int(rest.split()[1]), name
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return {pid: names.get(pid, "?") for pid in tree}


def listeners(root: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket that a process of
    ``root``'s tree holds."""
    sockets, out = _listening(), []
    for pid, name in _tree(root).items():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:["):-1])
                if inode in sockets:
                    out.append((name, *sockets[inode]))
    return sorted(set(out))


def beyond_loopback(found: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The listeners on an address other than loopback (an IPv4-mapped 127.x included)."""
    def loopback(text: str) -> bool:
        address = ipaddress.ip_address(text)
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    return [entry for entry in found if not loopback(entry[1])]


def test_the_address_reading_of_proc() -> None:
    assert str(_address("0100007F")) == "127.0.0.1"
    assert str(_address("00000000")) == "0.0.0.0"
    assert str(_address("00000000000000000000000000000000")) == "::"
    mapped = _address("0000000000000000FFFF00000100007F")
    assert mapped == ipaddress.ip_address("::ffff:127.0.0.1")
    assert str(_address("00000000000000000000000001000000")) == "::1"
    assert beyond_loopback([("a", str(mapped), 1), ("b", "127.0.0.2", 2),
                            ("c", "0.0.0.0", 3), ("d", "::", 4), ("e", "::1", 5),
                            ("f", "192.0.2.2", 6)]) == [("c", "0.0.0.0", 3), ("d", "::", 4),
                                                         ("f", "192.0.2.2", 6)]


def test_this_reading_sees_a_socket_on_every_interface() -> None:
    with socket.socket() as everywhere, socket.socket() as local:
        everywhere.bind(("", 0))
        everywhere.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        outside = [(a, p) for _, a, p in beyond_loopback(listeners(os.getpid()))]
        assert ("0.0.0.0", everywhere.getsockname()[1]) in outside
        assert local.getsockname()[1] not in [p for _, p in outside]


LOCAL_RAY = """
import json, os, sys
from pairforge.config import RayConfig
from pairforge.pipeline.ray_runtime import init_ray
init_ray(RayConfig(num_cpus=1, object_store_memory=100 * 1024**2))
import ray
@ray.remote
def pid(): return os.getpid()
print(json.dumps([ray.get(pid.remote()), ray.util.get_node_ip_address()]), flush=True)
sys.stdin.readline()
"""


def _local_ray_listeners(env: dict[str, str]) -> tuple[list[tuple[str, str, int]], str]:
    """The listeners of a local Ray that ``init_ray`` started in a subprocess (with a
    task's worker up), and its node's address."""
    for _ in range(2):  # a second try: Ray gives its raylet a fixed 30 s to register,
        # which a loaded 2-core machine can miss ("node timed out during startup")
        proc = subprocess.Popen([sys.executable, "-c", LOCAL_RAY], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True,
                                env={k: v for k, v in {**os.environ, **env}.items()
                                     if k != "RAY_ADDRESS"})
        try:
            line = proc.stdout.readline()
            found = listeners(proc.pid) if line else []
        finally:
            proc.communicate("\n", timeout=120)
        if line:
            assert proc.returncode == 0
            return found, json.loads(line)[1]
    raise AssertionError("the local Ray did not start twice")


def test_a_local_ray_listens_on_loopback_only() -> None:
    """What a build starts: the GCS, the raylet's two servers, the agents, the driver's and
    the worker's core-worker servers, all on loopback; with ``loopback`` switched off, Ray's
    own binding (the node's address, every interface) is back."""
    found, node = _local_ray_listeners({"PAIRFORGE_RAY_PRIVATE_OFF": ""})
    names = {name for name, _, _ in found}
    assert node == "127.0.0.1"
    assert {"gcs_server", "raylet"} <= names, found
    assert any(name.startswith("python") for name in names), found  # python3 in a venv
    assert len(found) >= 6, found  # GCS, raylet x2, driver, worker, agents
    assert beyond_loopback(found) == []
    found, node = _local_ray_listeners({"PAIRFORGE_RAY_PRIVATE_OFF": "loopback"})
    if ipaddress.ip_address(node).is_loopback:
        pytest.skip("this host has no address but loopback: Ray's own choice is loopback")
    assert {name for name, _, _ in beyond_loopback(found)} >= {"gcs_server", "raylet"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, int]]:
    """``pairforge serve`` with the default ``serve.host`` (HAProxy on, as shipped)."""
    tmp, port = tmp_path_factory.mktemp("listeners"), _free_port()
    config = {"input": {"path": "unused"},
              "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
              "download": {"image": {"image_size": 32, "encode_format": "png"}},
              "process": {"recaption": {"enabled": True, "model": str(SAMPLE / "captioner"),
                                        "max_new_tokens": 8, "grounding": {"enabled": False},
                                        "cache": {"enabled": False}}},
              "serve": {"port": port, "ingress_num_cpus": 0.1, "drain_s": 5}}
    (tmp / "serve.json").write_text(json.dumps(config))
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 (closed below)
    # as shipped: a local Ray (no RAY_ADDRESS), no private Ray API switched off
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "PAIRFORGE_RAY_PRIVATE_OFF")}
    proc = subprocess.Popen([sys.executable, "-c", "from pairforge.cli import app; app()",
                             "serve", str(tmp / "serve.json")],
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "serving captions" not in (tmp / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        yield proc, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_the_service_listens_on_loopback_only(service) -> None:
    """With a caption answered (so the ingress has called the model replica over Serve's
    gRPC), every listener of the service's processes is on loopback: HAProxy's port, Ray's
    core servers, its agents, and each replica's inter-deployment gRPC server."""
    proc, port = service
    scene = sorted((SAMPLE / "images").glob("*.png"))[0]
    answer = requests.post(f"http://127.0.0.1:{port}/v1/captions", data=scene.read_bytes(),
                           headers={"Content-Type": "image/png"}, timeout=120)
    assert answer.status_code == 200 and answer.json()["caption"]
    found = listeners(proc.pid)
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet", "haproxy"} <= names, found
    assert [(a, p) for name, a, p in found if name == "haproxy"] == [("127.0.0.1", port)]
    replicas = [entry for entry in found if entry[0].startswith("ray::ServeRepli")]
    # each of the two replicas (ingress, model): its core-worker and its Serve gRPC server;
    # the ingress also its HTTP server behind HAProxy
    assert len(replicas) >= 5, found
    assert beyond_loopback(found) == []
    assert [e for e in found if e[1] in ("0.0.0.0", "::")] == []
