"""``pairforge serve`` under hostile input, over real HTTP on 127.0.0.0/8 (issue 46).

Two services start per module, each the real ``pairforge serve`` in its own process with
its own local Ray, on one host: ``guarded`` (a bearer token, no URL allow-list) and
``open`` (no token, ``serve.allow_addresses`` 127.0.0.1/32 only, a 250 M pixel cap above
Pillow's own, a 21 MB body cap). Attackers connect from 127.0.0.2 and 127.0.0.3, honest
clients from 127.0.0.1; URLs are refused at 127.0.0.2. Each test asserts a status and a
bounded time; "< 1 s" targets get LOADED_S here (a loaded 2-core machine: the measured
figures are in bench/RESULTS.md). The last test stops ``open`` with SIGTERM under load.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from loopback_server import make_bomb_png

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "pairforge" / "sample"
SCENES = sorted((SAMPLE / "images").glob("*.png"))
TOKEN_ENV, TOKEN = "PAIRFORGE_HOSTILE_TOKEN", "hostile-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# the "< 1 s" targets on a loaded 2-core CI machine (the stalls guarded against last 30 s)
LOADED_S = 5.0
# a stalled URL's deadline: longer than an upload takes on a loaded machine (slow-URL test)
URL_TIMEOUT_S = 8.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**serve: object) -> dict:
    return {"input": {"path": "unused"},
            "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
            "download": {"allow_addresses": ["127.0.0.1/32"],  # the service ignores this
                         "image": {"image_size": 32, "encode_format": "png"}},
            "process": {"recaption": {"enabled": True, "model": str(SAMPLE / "captioner"),
                                      "max_new_tokens": 24, "grounding": {"enabled": False},
                                      "cache": {"enabled": False}}},
            "serve": {"ingress_num_cpus": 0.1, "url_timeout_s": URL_TIMEOUT_S, "drain_s": 20,
                      "cache": {"max_entries": 0}, **serve}}


class Service:
    def __init__(self, tmp: Path, name: str, env: dict[str, str], **serve: object) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / f"{name}.json"
        config.write_text(json.dumps(_config(port=self.port, **serve)))
        self.log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-c", "from pairforge.cli import app; "
                                       "app()", "serve", str(config)],
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            # "serving": start_service has returned and SIGTERM is the service's (while
            # Serve's start waits for the application to be RUNNING, Ray's handler exits)
            serving = "serving captions" in Path(self.log.name).read_text()
            try:
                if serving and requests.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not ready: {Path(self.log.name).read_text()[-3000:]}")

    def tree(self) -> list[int]:
        """The driver's pid and its descendants' (Ray's processes, HAProxy), from /proc."""
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        tree = [self.proc.pid]
        for pid in tree:
            tree += [child for child, parent in parents.items() if parent == pid]
        return tree

    def folder(self) -> list[Path]:
        return list(Path("/tmp").glob(f"pfs{self.proc.pid}-*"))

    def ingress_rss(self) -> int:
        """Bytes resident in the ingress replica's process."""
        total = 0
        for pid in self.tree():
            try:
                if b"CaptionIngress" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    status = Path(f"/proc/{pid}/status").read_text()
                    total += int(status.split("VmRSS:")[1].split()[0]) * 1024
            except (OSError, IndexError):
                continue
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[dict[str, Service]]:
    tmp = tmp_path_factory.mktemp("hostile")
    started = {"guarded": Service(tmp, "guarded", {TOKEN_ENV: TOKEN}, token_env=TOKEN_ENV,
                                  http_request_timeout_s=3),
               "open": Service(tmp, "open", {}, allow_addresses=["127.0.0.1/32"],
                               max_image_pixels=250_000_000,
                               max_body_bytes=21 * 1024**2)}
    try:
        deadline = time.monotonic() + 300
        for service in started.values():
            service.wait_ready(deadline)
        yield started
    finally:
        for service in started.values():
            service.stop()


def _caption(url: str, i: int = 0, **kw: object) -> requests.Response:
    return requests.post(url + "/v1/captions", data=SCENES[i].read_bytes(), timeout=60,
                         headers={"Content-Type": "image/png", **kw.pop("headers", {})}, **kw)


def _timed(call, *args, **kw) -> tuple[requests.Response, float]:  # noqa: ANN001
    started = time.monotonic()
    response = call(*args, **kw)
    return response, time.monotonic() - started


def _health_and_caption_answer(url: str, label: str, image: int) -> None:
    """/healthz and a caption (of sample ``image``) both answer 200 within LOADED_S."""
    health, health_s = _timed(requests.get, url + "/healthz", timeout=30)
    caption, caption_s = _timed(_caption, url, image, headers=AUTH)
    _record(f"{label}: /healthz", health_s)
    _record(f"{label}: caption", caption_s)
    assert (health.status_code, caption.status_code) == (200, 200)
    assert health_s < LOADED_S and caption_s < LOADED_S, (health_s, caption_s)


def _record(name: str, seconds: float) -> None:
    """A measured time, added to the JSON lines file ``$PAIRFORGE_HOSTILE_FIGURES`` names
    (bench/RESULTS.md quotes them; the asserts allow LOADED_S)."""
    path = os.environ.get("PAIRFORGE_HOSTILE_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": name, "seconds": round(seconds, 3)}) + "\n")


# -- ports and listeners ------------------------------------------------------------------

def _ray_haproxy_config(folder: Path) -> str:
    """The HAProxy configuration the installed Ray writes for one app on 127.0.0.1."""
    from ray.serve._private.haproxy import (
        BackendConfig,
        HAProxyApi,
        HAProxyConfig,
        ServerConfig,
    )
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(socket_path=f"{folder}/admin.sock", server_state_base=str(folder),
                        server_state_file=f"{folder}/state",
                        metrics_socket_path=f"{folder}/metrics.sock",
                        http_options=HTTPOptions(host="127.0.0.1", port=_free_port()))
    api = HAProxyApi(cfg=cfg, config_file_path=f"{folder}/haproxy.cfg")
    api.set_backend_configs({"app": BackendConfig(name="app", path_prefix="/", servers=[
        ServerConfig(name="replica", host="127.0.0.1", port=_free_port())])})
    api._generate_config_file_internal()
    return (folder / "haproxy.cfg").read_text()


def test_the_hook_applies_to_the_installed_rays_haproxy_config(tmp_path) -> None:
    """Without a service: Ray's own renderer, then ``harden``; HAProxy itself checks the
    result (``haproxy -c``). Fails by name when a Ray upgrade changes the template."""
    from pairforge.pipeline.ray_runtime import haproxy_binary
    from pairforge.serve.haproxy_hook import harden

    ray_text = _ray_haproxy_config(tmp_path)
    assert "bind *:" in ray_text and "mode 666 level admin" in ray_text  # what it fixes
    settings = {"host": "127.0.0.1", "stats_listeners": False, "http_request_timeout_s": 7,
                "client_timeout_s": 30, "server_timeout_s": 35, "max_connections": 5000,
                "max_connections_per_source": 99}
    text = harden(ray_text, settings)
    assert harden(text, settings) == text  # a reload may see it again
    binds = [line.split()[1] for line in text.splitlines() if line.strip().startswith("bind")]
    assert len(binds) == 1 and binds[0].startswith("127.0.0.1:")
    for line in ("mode 600 level admin", "timeout http-request 7s", "timeout client 30s",
                 "timeout server 35s", "option http-buffer-request", "maxconn 5000",
                 "sc0_conn_cur gt 99"):
        assert line in text, line
    shown = harden(ray_text, {**settings, "stats_listeners": True})
    binds = [line.split()[1] for line in shown.splitlines() if line.strip().startswith("bind")]
    assert len(binds) == 3 and all(b.startswith("127.0.0.1:") for b in binds)
    for candidate in (text, shown):
        (tmp_path / "checked.cfg").write_text(candidate)
        checked = subprocess.run([haproxy_binary(), "-c", "-f", str(tmp_path / "checked.cfg")],
                                 capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def _listeners(service: Service) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of the service's
    processes (its driver, Ray's processes, HAProxy), from ``ss -ltnp``."""
    tree, out = set(service.tree()), []
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    for line in lines.splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in tree:
                out.append((name, address.strip("[]"), int(port)))
    return out


def test_two_services_on_one_host_answer_only_their_own_requests(services) -> None:
    """Each service's fallback proxy has its own free port (Ray's fixed 8500 was bound by
    both with SO_REUSEPORT): 20 requests to each port reach that service only (``guarded``
    wants a token, ``open`` does not)."""
    guarded, open_ = services["guarded"], services["open"]
    with ThreadPoolExecutor(8) as pool:
        to_guarded = list(pool.map(lambda i: _caption(guarded.url, i).status_code, range(20)))
        to_open = list(pool.map(lambda i: _caption(open_.url, i).status_code, range(20)))
    assert to_guarded == [401] * 20 and to_open == [200] * 20
    ports = [{port for _, _, port in _listeners(s)} for s in (guarded, open_)]
    assert not ports[0] & ports[1]  # no port is shared (and none is 8500 in both)
    for service in (guarded, open_):
        assert requests.get(service.url + "/readyz", timeout=10).status_code == 200


def test_nothing_listens_on_every_interface_and_the_admin_socket_is_private(services) -> None:
    for service in services.values():
        listeners = _listeners(service)
        assert [entry for entry in listeners if entry[1] == "0.0.0.0"] == []
        assert {(addr, port) for name, addr, port in listeners if name == "haproxy"} \
            == {("127.0.0.1", service.port)}  # no stats page, no Prometheus listener
        (folder,) = service.folder()
        assert folder.stat().st_mode & 0o777 == 0o700
        (sock,) = folder.glob("*/admin.sock")
        assert sock.stat().st_mode & 0o777 == 0o600
        assert "mode 600 level admin" in next(folder.glob("*/haproxy.cfg")).read_text()


def test_the_token_is_not_in_the_workers_environment(services) -> None:
    guarded = services["guarded"]
    driver, *children = guarded.tree()
    token = f"{TOKEN_ENV}={TOKEN}".encode()
    assert token in Path(f"/proc/{driver}/environ").read_bytes()  # the driver read it there
    environs = []
    for pid in children:
        with contextlib.suppress(OSError):
            environs.append(Path(f"/proc/{pid}/environ").read_bytes())
    assert len(environs) > 5 and not [e for e in environs if TOKEN.encode() in e]


# -- connection exhaustion ----------------------------------------------------------------

def _open_from(source: str, port: int, count: int, first_bytes: bytes) -> list[socket.socket]:
    """``count`` connections from ``source`` that each send ``first_bytes`` and stall."""
    held = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((source, 0))
        with contextlib.suppress(BlockingIOError):
            sock.connect(("127.0.0.1", port))
        held.append(sock)
    time.sleep(0.5)
    for sock in held:
        with contextlib.suppress(OSError):  # HAProxy closed it: over the per-source limit
            sock.send(first_bytes)
    return held


def _still_open(held: list[socket.socket]) -> int:
    """How many of ``held`` the server has not closed."""
    count = 0
    for sock in held:
        try:
            count += sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            count += 1
        except OSError:
            continue
    return count


def test_half_open_connections_and_slow_bodies_leave_health_and_captions_answering(
        services) -> None:
    """4,200 half-sent headers from one address: HAProxy keeps 256 and closes the rest as
    they arrive. Then 300 slow bodies (with the token) from five addresses, 60 each: HAProxy
    holds each until its body is in, so none takes a replica's slot. /healthz and a caption
    from 127.0.0.1 stay prompt throughout; a half-sent request gets 408 after
    ``serve.http_request_timeout_s`` (3 s here)."""
    guarded = services["guarded"]
    held: list[socket.socket] = []
    try:
        (late,) = _open_from("127.0.0.4", guarded.port, 1, b"GET /healthz HTTP/1.1\r\n")
        started = time.monotonic()
        half_open = _open_from("127.0.0.2", guarded.port, 4200,
                               b"POST /v1/captions HTTP/1.1\r\nHost: x\r\nContent-")
        held += half_open
        _health_and_caption_answer(guarded.url, "4200 half-open", 30)
        assert 240 <= _still_open(half_open) <= 256
        for source in range(5, 10):
            held += _open_from(f"127.0.0.{source}", guarded.port, 60,
                               b"POST /v1/captions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               b"image/png\r\nAuthorization: Bearer " + TOKEN.encode()
                               + b"\r\nContent-Length: 1000000\r\n\r\n\x89PNG")
        _health_and_caption_answer(guarded.url, "+300 slow bodies", 31)
        late.setblocking(True)
        late.settimeout(10)
        assert late.recv(100).startswith(b"HTTP/1.1 408")
        assert 2.9 < time.monotonic() - started < 3 + LOADED_S + 1  # + its own connect
    finally:
        for sock in held + [late]:
            sock.close()


# -- request bodies -----------------------------------------------------------------------

def test_a_20_mb_multipart_body_of_tiny_parts_is_refused_at_once(services) -> None:
    """Refused by the part limit as the streaming parser reaches part 9, on the decode
    threads (the event loop keeps answering), without growing the ingress by much."""
    open_ = services["open"]
    part = b'--b\r\nContent-Disposition: form-data; name="n"\r\n\r\nx\r\n'
    body = part * (20 * 1024**2 // len(part)) + b"--b--\r\n"
    rss = open_.ingress_rss()
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(_timed, requests.post, open_.url + "/v1/captions", data=body,
                          headers={"Content-Type": "multipart/form-data; boundary=b"},
                          timeout=60)
        time.sleep(0.1)
        other, other_s = _timed(_caption, open_.url, 40)
        refused, refused_s = big.result()
    _record("20 MB multipart of tiny parts: refused", refused_s)
    _record("20 MB multipart of tiny parts: a caption meanwhile", other_s)
    assert (refused.status_code, refused.json()["error"]) == (400, "too_many_parts")
    assert refused_s < LOADED_S, refused_s
    assert other.status_code == 200 and other_s < LOADED_S, other_s
    assert open_.ingress_rss() - rss < 200 * 1024**2


def test_deep_json_a_pixel_cap_above_pillows_and_the_latency_by_status(services) -> None:
    open_ = services["open"]
    deep, deep_s = _timed(requests.post, open_.url + "/v1/captions", data=b"[" * 100_000,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert (deep.status_code, deep.json()["error"]) == (400, "malformed_json")
    assert deep_s < LOADED_S
    # 256 M pixels: over the service's 250 M cap, under twice Pillow's 89 M (179 M) no more
    bomb, bomb_s = _timed(requests.post, open_.url + "/v1/captions",
                          data=make_bomb_png(16_000), headers={"Content-Type": "image/png"},
                          timeout=60)
    assert (bomb.status_code, bomb.json()["error"]) == (413, "image_too_large")
    assert "250000000" in bomb.json()["detail"] and "178956970" not in bomb.json()["detail"]
    assert bomb_s < LOADED_S
    metrics = requests.get(open_.url + "/metrics", timeout=10).text
    assert 'pairforge_serve_request_seconds_count{code="400"}' in metrics
    assert 'pairforge_serve_request_seconds_count{code="200"}' in metrics


# -- URLs ---------------------------------------------------------------------------------

def _stalling_listener() -> socket.socket:
    """Accepts connections on 127.0.0.1 and never answers: an open port that stalls."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener


def _url(service: Service, url: str) -> tuple[requests.Response, float]:
    return _timed(requests.post, service.url + "/v1/captions", json={"url": url},
                  headers=AUTH, timeout=60)


def test_url_answers_do_not_tell_open_ports_from_closed(services) -> None:
    """``guarded`` has no allow-list (download's does not apply): loopback is refused
    whatever listens there. ``open`` allows 127.0.0.1 only: a closed port and a stalling
    one get the same answer after the same deadline (URL_TIMEOUT_S); 127.0.0.2 is refused."""
    stall = _stalling_listener()
    open_port, closed_port = stall.getsockname()[1], _free_port()
    try:
        answers = {(name, port): _url(services[name], f"http://127.0.0.1:{port}/a.png")
                   for name in ("guarded", "open") for port in (open_port, closed_port)}
        elsewhere, _ = _url(services["open"], "http://127.0.0.2/a.png")
    finally:
        stall.close()
    for port in (open_port, closed_port):
        response, _ = answers["guarded", port]
        assert (response.status_code, response.json()["error"]) == (403, "url_blocked_address")
    assert answers["guarded", open_port][0].json() == answers["guarded", closed_port][0].json()
    for port in (open_port, closed_port):
        response, took = answers["open", port]
        assert (response.status_code, response.json()["error"]) == (422, "url_unreachable")
        assert URL_TIMEOUT_S - 0.1 < took < URL_TIMEOUT_S + LOADED_S, took
    assert answers["open", open_port][0].json() == answers["open", closed_port][0].json()
    assert (elsewhere.status_code, elsewhere.json()["error"]) == (403, "url_blocked_address")


def test_slow_urls_do_not_delay_uploads(services) -> None:
    """12 URLs that stall fill the URL pool (4 threads); an upload meanwhile goes through
    the decode pool and the model at once. The service answers each stalled URL at its
    deadline (URL_TIMEOUT_S, counted from arrival, queued or not), so an upload queued
    behind them would come back after them: the assert is on that order, not on a clock
    (CI's load has taken an upload to 2.6 s, and 3.9 s at load 50)."""
    open_ = services["open"]
    stall = _stalling_listener()
    try:
        with ThreadPoolExecutor(12) as pool:
            slow = [pool.submit(_url, open_, f"http://127.0.0.1:{stall.getsockname()[1]}"
                                f"/{i}.png") for i in range(12)]
            time.sleep(0.3)
            upload, upload_s = _timed(_caption, open_.url, 50)
            answered_first = sum(future.done() for future in slow)
            answers = [future.result()[0].status_code for future in slow]
    finally:
        stall.close()
    _record("12 slow URLs: an upload meanwhile", upload_s)
    assert upload.status_code == 200
    assert answered_first == 0, (answered_first, upload_s)
    assert answers == [422] * 12


def test_a_thin_strip_is_refused_before_its_upscale_is_allocated(services) -> None:
    import io

    from PIL import Image

    strip = io.BytesIO()
    Image.new("L", (1, 60_000)).save(strip, format="PNG")  # upscaled: 32 x 1.9 M pixels
    open_ = services["open"]
    rss = open_.ingress_rss()
    response, took = _timed(requests.post, open_.url + "/v1/captions",
                            data=strip.getvalue(), headers={"Content-Type": "image/png"},
                            timeout=60)
    assert response.status_code in (413, 422), response.text
    assert took < LOADED_S and open_.ingress_rss() - rss < 200 * 1024**2


# -- stopping -----------------------------------------------------------------------------

def test_sigterm_finishes_every_request_in_flight_then_exits_0(services) -> None:
    """SIGTERM once 48 requests are sent and most still wait (the cache is off: each
    upload runs the model, a few batches a second on 2 cores): the port closes, every
    request in flight is answered, the process exits 0 and its HAProxy folder is gone."""
    open_ = services["open"]
    folder = open_.folder()
    sent, results = threading.Semaphore(0), []

    def send(i: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", open_.port, timeout=60)
        try:
            connection.request("POST", "/v1/captions", SCENES[100 + i].read_bytes(),
                               {"Content-Type": "image/png"})
            sent.release()  # the whole request is on its way: from here it is in flight
            results.append(connection.getresponse().status)
        except OSError as err:
            results.append(type(err).__name__)
        finally:
            connection.close()

    clients = [threading.Thread(target=send, args=(i,)) for i in range(48)]
    for client in clients:
        client.start()
    for _ in clients:
        assert sent.acquire(timeout=30)
    time.sleep(0.2)  # and accepted by HAProxy (a connection still in the kernel's queue
    in_flight = 48 - len(results)  # when the listener closes is refused, as anywhere)
    stopped = time.monotonic()
    open_.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(requests.ConnectionError):  # no new connections once draining
        requests.get(open_.url + "/healthz", timeout=5)
    for client in clients:
        client.join(60)
    assert in_flight >= 16
    assert results == [200] * 48
    assert open_.proc.wait(60) == 0
    _record(f"SIGTERM with {in_flight} in flight: exit 0", time.monotonic() - stopped)
    assert time.monotonic() - stopped < 20 + 30  # drain_s, then Ray's shutdown
    assert folder and not any(path.exists() for path in folder)
