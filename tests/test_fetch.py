"""The fetcher against loopback servers. Only 127.x addresses ever receive traffic."""

from __future__ import annotations

import io
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from loopback_server import LoopbackServer, loopback_download_config, make_bomb_png, pixel_count

from pairforge import __version__
from pairforge.backoff import backoff_seconds, parse_retry_after
from pairforge.download import fetch as fetch_module
from pairforge.download.fetch import (
    Fetcher,
    FetchResult,
    robots_opt_out,
)
from pairforge.records import Status

# PAIRFORGE_TEST_FETCHER=urllib3 runs every case against bench/fetch_urllib3.py, the urllib3
# client that fetch.py's was measured against (issue 33, bench/RESULTS.md).
if os.environ.get("PAIRFORGE_TEST_FETCHER") == "urllib3":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from fetch_urllib3 import Urllib3Fetcher as Fetcher  # type: ignore[assignment]  # noqa: F811


@pytest.fixture
def fetcher() -> Iterator[Fetcher]:
    with Fetcher(loopback_download_config()) as f:
        yield f


def make_fetcher(**overrides: object) -> Fetcher:
    return Fetcher(loopback_download_config(**overrides))


def get(server: LoopbackServer, path: str, **overrides: object) -> FetchResult:
    with make_fetcher(**overrides) as f:
        return f.fetch(server.url(path))


# --------------------------------------------------------------------------- success


def test_image_ok(fetcher: Fetcher, http_server: LoopbackServer, image_dir: Path) -> None:
    url = http_server.url("/img/red.jpg")
    result = fetcher.fetch(url)
    assert result == FetchResult(Status.OK, None, (image_dir / "red.jpg").read_bytes(), 200, url)


def test_chunked_body(fetcher: Fetcher, http_server: LoopbackServer, image_dir: Path) -> None:
    result = fetcher.fetch(http_server.url("/chunked/blue.png"))
    assert result.status == Status.OK
    assert result.body == (image_dir / "blue.png").read_bytes()


def test_fetch_does_not_judge_content(fetcher: Fetcher, http_server: LoopbackServer,
                                      image_dir: Path) -> None:
    # Not-an-image and truncated images are the decode step's to classify.
    html = fetcher.fetch(http_server.url("/html"))
    assert html.status == Status.OK and html.body.startswith(b"<!doctype html>")
    half = fetcher.fetch(http_server.url("/truncated/red.jpg"))
    full = (image_dir / "red.jpg").read_bytes()
    assert half.status == Status.OK and half.body == full[: len(full) // 2]


def test_bomb_is_small_on_the_wire(fetcher: Fetcher, http_server: LoopbackServer) -> None:
    from PIL import Image

    result = fetcher.fetch(http_server.url("/bomb.png"))
    assert result.status == Status.OK
    assert result.body == make_bomb_png() and len(result.body) < 200_000
    assert pixel_count(result.body) == 20000 * 20000
    # A valid PNG that Pillow's own header check already calls a bomb.
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(result.body))


def test_request_line_and_headers(http_server: LoopbackServer) -> None:
    assert get(http_server, "/img/red.jpg").status == Status.OK
    (seen,) = http_server.headers_seen("/img/red.jpg")
    assert seen[":version"] == "HTTP/1.1"
    assert seen["User-Agent"] == f"pairforge/{__version__} (+https://github.com/pairforge/pairforge)"
    assert seen["Host"] == f"127.0.0.1:{http_server.port}"


def test_user_agent(http_server: LoopbackServer) -> None:
    agent = "mytoken/2.0 (+https://example.org/bot)"
    assert get(http_server, "/img/red.jpg", user_agent=agent).status == Status.OK
    (seen,) = http_server.headers_seen("/img/red.jpg")
    assert seen["User-Agent"] == agent


def test_non_ascii_path_is_quoted(fetcher: Fetcher, http_server: LoopbackServer) -> None:
    result = fetcher.fetch(http_server.url("/img/red.jpg?q=bücher und"))
    assert result.status == Status.OK
    assert http_server.hits("/img/red.jpg") == 1


# --------------------------------------------------------------------------- HTTP errors


@pytest.mark.parametrize("code", [400, 403, 404, 410])
def test_client_errors_are_not_retried(http_server: LoopbackServer, code: int) -> None:
    result = get(http_server, f"/status/{code}")
    assert (result.status, result.error, result.http_status) == (
        Status.HTTP_ERROR, f"HTTP {code}", code)
    assert http_server.hits(f"/status/{code}") == 1


@pytest.mark.parametrize("code", [500, 503, 429])
def test_server_errors_are_retried(http_server: LoopbackServer, code: int) -> None:
    result = get(http_server, f"/status/{code}", retries=2)
    assert result.status == Status.HTTP_ERROR and result.http_status == code
    assert result.error == f"HTTP {code} (after 3 tries)"
    assert http_server.hits(f"/status/{code}") == 3


def test_500_then_ok(http_server: LoopbackServer) -> None:
    result = get(http_server, "/flaky/a?fail=2", retries=2)
    assert result.status == Status.OK and result.http_status == 200
    assert http_server.hits("/flaky/a") == 3


def test_500_without_retries(http_server: LoopbackServer) -> None:
    result = get(http_server, "/flaky/b?fail=1", retries=0)
    assert (result.status, result.error) == (Status.HTTP_ERROR, "HTTP 500")
    assert http_server.hits("/flaky/b") == 1


def test_backoff_is_jittered_within_its_doubling_bound(http_server: LoopbackServer) -> None:
    """Full jitter (download/politeness.py): each wait is in [0, backoff x 2^attempt],
    so the two waits of three tries add up to at most 0.1 + 0.2 s."""
    start = time.monotonic()
    result = get(http_server, "/status/503", retries=2, backoff=0.1)
    assert result.status == Status.HTTP_ERROR and "after 3 tries" in result.error
    assert http_server.hits("/status/503") == 3
    assert time.monotonic() - start < 0.1 + 0.2 + 0.5


@pytest.mark.parametrize("form", ["secs=1", "secs=1&date=1"])
def test_429_with_retry_after_then_ok(http_server: LoopbackServer, form: str) -> None:
    start = time.monotonic()
    result = get(http_server, f"/retry-after/x?{form}", backoff=0.0)
    assert result.status == Status.OK
    assert http_server.hits("/retry-after/x") == 2
    if form == "secs=1":
        assert time.monotonic() - start >= 0.95  # waited as told, not the 0 s backoff


def test_retry_after_too_long_gives_up_at_once(http_server: LoopbackServer) -> None:
    start = time.monotonic()
    result = get(http_server, "/retry-after/y?secs=100", max_retry_after=5.0)
    assert result.status == Status.HTTP_ERROR and result.http_status == 429
    assert "Retry-After 100 s" in result.error and "max_retry_after" in result.error
    assert http_server.hits("/retry-after/y") == 1
    assert time.monotonic() - start < 1.0


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after(" 7 ") == 7.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


def test_backoff_honours_retry_after_then_backs_off_with_jitter() -> None:
    assert backoff_seconds(0, "7") == 7.0
    assert backoff_seconds(0, "600") == 60.0  # capped
    for attempt in range(6):
        wait = backoff_seconds(attempt, "soon")  # unparsable: exponential with jitter
        full = min(0.5 * 2 ** attempt, 30.0)
        assert full / 2 <= wait <= full


# --------------------------------------------------------------------------- connection failures


def unused_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_connection_refused() -> None:
    with make_fetcher(retries=1) as f:
        result = f.fetch(f"http://127.0.0.1:{unused_loopback_port()}/img/red.jpg")
    assert result.status == Status.DOWNLOAD_ERROR and "(after 2 tries)" in result.error


def test_connection_closed_without_response(http_server: LoopbackServer) -> None:
    result = get(http_server, "/reset", retries=1)
    assert result.status == Status.DOWNLOAD_ERROR
    assert http_server.hits("/reset") == 2


def test_not_http(http_server: LoopbackServer) -> None:
    result = get(http_server, "/garbage", retries=0)
    assert result.status == Status.DOWNLOAD_ERROR and "bad response" in result.error


def test_trickling_body_times_out(http_server: LoopbackServer) -> None:
    start = time.monotonic()
    result = get(http_server, "/slow?interval=0.05&size=1000", timeout=0.5)
    elapsed = time.monotonic() - start
    assert result.status == Status.TIMEOUT and result.http_status == 200
    assert 0.45 <= elapsed < 1.5  # a deadline for the request, not a per-recv timeout


def test_stalled_headers_time_out(http_server: LoopbackServer) -> None:
    start = time.monotonic()
    result = get(http_server, "/stall?secs=3", timeout=0.5, retries=2)
    assert result.status == Status.TIMEOUT
    assert http_server.hits("/stall") == 1  # timeouts are not retried
    assert time.monotonic() - start < 1.5


# --------------------------------------------------------------------------- byte cap


def test_content_length_over_cap(http_server: LoopbackServer) -> None:
    result = get(http_server, "/big?size=5000", max_bytes=1000)
    assert result.status == Status.TOO_LARGE and result.body is None
    assert result.error == "Content-Length 5000 over 1000 bytes"


def test_chunked_body_over_cap(http_server: LoopbackServer) -> None:
    result = get(http_server, "/big?size=300000&chunked=1", max_bytes=100_000)
    assert result.status == Status.TOO_LARGE and result.error == "body over 100000 bytes"


@pytest.mark.parametrize("chunked", ["0", "1"])
def test_cap_is_inclusive(http_server: LoopbackServer, chunked: str) -> None:
    ok = get(http_server, f"/big?size=1000&chunked={chunked}", max_bytes=1000)
    assert ok.status == Status.OK and len(ok.body) == 1000
    over = get(http_server, f"/big?size=1001&chunked={chunked}", max_bytes=1000)
    assert over.status == Status.TOO_LARGE


def test_large_body_under_cap(http_server: LoopbackServer) -> None:
    result = get(http_server, "/big?chunked=1")  # 2 MiB, default cap 20 MiB
    assert result.status == Status.OK and len(result.body) == http_server.big_size


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_redirect_followed(http_server: LoopbackServer, code: int, image_dir: Path) -> None:
    target = http_server.url("/img/blue.png")
    path = f"/redirect-to?code={code}&url={urllib.parse.quote(target)}"
    result = get(http_server, path)
    assert result.status == Status.OK and result.final_url == target
    assert result.body == (image_dir / "blue.png").read_bytes()


def test_redirect_chain_within_limit(http_server: LoopbackServer) -> None:
    result = get(http_server, "/redirect-chain/3", max_redirects=3)
    assert result.status == Status.OK
    assert result.final_url == http_server.url("/redirect-chain/0")


def test_too_many_redirects(http_server: LoopbackServer) -> None:
    result = get(http_server, "/redirect-chain/5", max_redirects=2)
    assert result.status == Status.TOO_MANY_REDIRECTS
    assert [http_server.hits(f"/redirect-chain/{n}") for n in range(5, 1, -1)] == [1, 1, 1, 0]


def test_redirect_loop(http_server: LoopbackServer) -> None:
    result = get(http_server, "/redirect-loop", max_redirects=10)
    assert result.status == Status.TOO_MANY_REDIRECTS and "loop" in result.error
    assert http_server.hits("/redirect-loop") == 1


def test_redirect_to_file_refused(http_server: LoopbackServer, image_dir: Path) -> None:
    file_url = (image_dir / "red.jpg").as_uri()
    result = get(http_server, f"/redirect-to?url={urllib.parse.quote(file_url)}",
                 allow_file_scheme=True)
    assert result.status == Status.BLOCKED_ADDRESS and result.body is None


# --------------------------------------------------------------------------- address guard


def test_refused_address_gets_no_request(http_server: LoopbackServer,
                                         refused_server: LoopbackServer) -> None:
    result = get(http_server, "/img/red.jpg")  # sanity: the allowed one works
    assert result.status == Status.OK
    url = refused_server.url("/img/red.jpg")
    result = get(refused_server, "/img/red.jpg")
    assert result.status == Status.BLOCKED_ADDRESS and result.final_url == url
    assert "127.0.0.2" in result.error and "loopback" in result.error
    assert refused_server.requests_seen == 0 and refused_server.connections == 0


def test_redirect_to_refused_address(http_server: LoopbackServer,
                                     refused_server: LoopbackServer) -> None:
    target = refused_server.url("/img/red.jpg")
    result = get(http_server, f"/redirect-to?url={urllib.parse.quote(target)}")
    assert result.status == Status.BLOCKED_ADDRESS and result.final_url == target
    assert http_server.hits("/redirect-to") == 1
    assert refused_server.requests_seen == 0 and refused_server.connections == 0


def test_default_config_refuses_loopback(http_server: LoopbackServer) -> None:
    with Fetcher(loopback_download_config(allow_addresses=[])) as f:
        result = f.fetch(http_server.url("/img/red.jpg"))
    assert result.status == Status.BLOCKED_ADDRESS
    assert http_server.requests_seen == 0


def install_fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> list:
    asked: list[str] = []

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list:
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


def forbid_connections(monkeypatch: pytest.MonkeyPatch) -> list:
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.mark.parametrize("address", ["169.254.169.254", "10.0.0.7", "100.64.0.1",
                                     "192.168.1.20", "100.100.100.200"])
def test_dns_to_refused_address_never_connects(monkeypatch: pytest.MonkeyPatch,
                                               address: str) -> None:
    install_fake_dns(monkeypatch, {"images.test": [address]})
    attempts = forbid_connections(monkeypatch)
    with make_fetcher() as f:
        result = f.fetch("http://images.test/cat.jpg")
    assert result.status == Status.BLOCKED_ADDRESS
    assert address in result.error and "images.test" in result.error
    assert attempts == []


def test_idn_host_is_looked_up_in_ascii(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = install_fake_dns(monkeypatch, {"xn--bcher-kva.test": ["10.0.0.1"]})
    attempts = forbid_connections(monkeypatch)
    with make_fetcher() as f:
        assert f.fetch("http://bücher.test/a.jpg").status == Status.BLOCKED_ADDRESS
    assert asked == ["xn--bcher-kva.test"] and attempts == []


def test_connects_to_the_vetted_address(monkeypatch: pytest.MonkeyPatch,
                                        http_server: LoopbackServer,
                                        refused_server: LoopbackServer) -> None:
    # The name resolves to a refused and an allowed address: only the allowed one is
    # contacted, and the name is looked up once (no second lookup to rebind).
    asked = install_fake_dns(monkeypatch, {"mixed.test": ["127.0.0.2", "127.0.0.1"]})
    with make_fetcher() as f:
        result = f.fetch(f"http://mixed.test:{http_server.port}/img/red.jpg")
    assert result.status == Status.OK
    assert asked == ["mixed.test"]
    assert http_server.headers_seen("/img/red.jpg")[0]["Host"] == f"mixed.test:{http_server.port}"
    assert refused_server.connections == 0


def test_dns_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def getaddrinfo(*args: object, **kwargs: object) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with make_fetcher() as f:
        result = f.fetch("http://nowhere.test/a.jpg")
    assert result.status == Status.DOWNLOAD_ERROR and "DNS" in result.error


# --------------------------------------------------------------------------- URLs and files


@pytest.mark.parametrize("url", [
    "", "   ", None, 42, "not a url", "ftp://127.0.0.1/a.jpg", "javascript:alert(1)",
    "data:image/png;base64,iVBORw0KGgo=", "http://", "http:///a.jpg",
    "http://127.0.0.1:99999/a.jpg", "http://[::1/a.jpg", "//127.0.0.1/a.jpg",
])
def test_invalid_urls(monkeypatch: pytest.MonkeyPatch, url: object) -> None:
    attempts = forbid_connections(monkeypatch)
    with make_fetcher() as f:
        result = f.fetch(url)  # type: ignore[arg-type]
    assert result.status == Status.INVALID_URL and result.error
    assert attempts == []


def test_file_scheme_off_by_default(image_dir: Path) -> None:
    with make_fetcher() as f:
        result = f.fetch((image_dir / "red.jpg").as_uri())
    assert result.status == Status.INVALID_URL and "allow_file_scheme" in result.error


def test_file_scheme_when_allowed(image_dir: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(2000))
    with make_fetcher(allow_file_scheme=True, max_bytes=1000) as f:
        ok = f.fetch((image_dir / "red.jpg").as_uri())
        assert ok.status == Status.OK and ok.body == (image_dir / "red.jpg").read_bytes()
        assert f.fetch(big.as_uri()).status == Status.TOO_LARGE
        assert f.fetch((tmp_path / "missing.jpg").as_uri()).status == Status.DOWNLOAD_ERROR
        spaced = tmp_path / "a b%20c.jpg"  # escapes in the URL are undone exactly once
        spaced.write_bytes(b"xyz")
        assert f.fetch(spaced.as_uri()).body == b"xyz"


# --------------------------------------------------------------------------- X-Robots-Tag


@pytest.mark.parametrize(("value", "opted_out"), [
    ("noai", True),
    ("noimageai", True),
    ("noindex", True),
    ("noimageindex", True),
    ("NoAI", True),
    ("nofollow, noai", True),
    ("nofollow", False),
    ("otherbot: noai", False),
    ("pairforge: noai", True),
    ("mytoken: noimageai", True),
    ("nofollow|noai", True),  # two headers
    ("otherbot: noai|nofollow", False),
])
def test_robots_header(http_server: LoopbackServer, value: str, opted_out: bool) -> None:
    path = "/robots/" + urllib.parse.quote(value) + "/red.jpg"
    result = get(http_server, path, user_agent="mytoken/1.0")
    assert result.status == (Status.OPTED_OUT if opted_out else Status.OK)
    if opted_out:
        assert result.body is None and result.error.startswith("X-Robots-Tag:")
        assert result.opt_out_reason == "x_robots_tag"


def test_robots_checked_before_body(http_server: LoopbackServer) -> None:
    # With a cap smaller than the image, reading the body first would say too_large.
    assert get(http_server, "/robots/noai/red.jpg", max_bytes=10).status == Status.OPTED_OUT


def test_robots_can_be_ignored(http_server: LoopbackServer) -> None:
    assert get(http_server, "/robots/noai/red.jpg", respect_robots=False).status == Status.OK


def test_robots_directive_subset(http_server: LoopbackServer) -> None:
    result = get(http_server, "/robots/noindex/red.jpg", robots_directives=["noai"])
    assert result.status == Status.OK


DIRECTIVES = ["noai", "noimageai", "noindex", "noimageindex"]


@pytest.mark.parametrize(("values", "agents", "expected"), [
    ([], ["pairforge"], None),
    (["noai"], ["pairforge"], "noai"),
    (["  NOINDEX , nofollow "], ["pairforge"], "NOINDEX , nofollow"),
    (["nofollow", "noimageai"], ["pairforge"], "noimageai"),
    (["otherbot: noai"], ["pairforge"], None),
    (["PairForge: noai"], ["pairforge"], "PairForge: noai"),
    (["mybot: noai, nofollow"], ["pairforge", "mybot"], "mybot: noai, nofollow"),
    (["mybot: noai"], ["pairforge"], None),
    (["otherbot: noai", "nofollow"], ["pairforge"], None),
    (["all"], ["pairforge"], None),
])
def test_robots_opt_out_pure(values: list[str], agents: list[str],
                             expected: str | None) -> None:
    assert robots_opt_out(values, DIRECTIVES, agents) == expected


# --------------------------------------------------------------------------- keep-alive


def test_keep_alive_reuses_one_connection(fetcher: Fetcher,
                                          http_server: LoopbackServer) -> None:
    for _ in range(10):
        assert fetcher.fetch(http_server.url("/img/red.jpg")).status == Status.OK
    # Error responses with small bodies keep the connection too.
    assert fetcher.fetch(http_server.url("/status/404")).status == Status.HTTP_ERROR
    assert fetcher.fetch(http_server.url("/img/blue.png")).status == Status.OK
    assert http_server.requests_seen == 12
    assert http_server.connections == 1


def test_keep_alive_across_threads(http_server: LoopbackServer) -> None:
    with make_fetcher(per_host_connections=4) as f, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(f.fetch, [http_server.url("/img/red.jpg")] * 40))
    assert all(r.status == Status.OK for r in results)
    assert http_server.requests_seen == 40
    assert http_server.connections <= 4


def test_server_closed_idle_connection(fetcher: Fetcher, http_server: LoopbackServer) -> None:
    assert fetcher.fetch(http_server.url("/close-after/red.jpg")).status == Status.OK
    time.sleep(0.05)
    assert fetcher.fetch(http_server.url("/img/red.jpg")).status == Status.OK
    assert http_server.connections == 2


def test_connection_close_header(fetcher: Fetcher, http_server: LoopbackServer,
                                 image_dir: Path) -> None:
    result = fetcher.fetch(http_server.url("/connection-close/red.jpg"))
    assert result.status == Status.OK and result.body == (image_dir / "red.jpg").read_bytes()
    assert fetcher.fetch(http_server.url("/img/red.jpg")).status == Status.OK
    assert http_server.connections == 2


def test_stale_connection_retried_once(monkeypatch: pytest.MonkeyPatch,
                                       http_server: LoopbackServer) -> None:
    # Hide the idle check so the request really goes out on the dead connection. The one
    # fresh try is not a retry: it happens with download.retries 0 too.
    monkeypatch.setattr(fetch_module, "_looks_closed", lambda conn: False)
    if Fetcher is not fetch_module.Fetcher:
        monkeypatch.setattr("urllib3.connectionpool.is_connection_dropped", lambda conn: False)
    with make_fetcher(retries=0) as fetcher:
        assert fetcher.fetch(http_server.url("/close-after/red.jpg")).status == Status.OK
        time.sleep(0.05)
        result = fetcher.fetch(http_server.url("/img/red.jpg"))
    assert result.status == Status.OK
    assert http_server.hits("/img/red.jpg") == 1 and http_server.connections == 2


def test_per_host_limit(http_server: LoopbackServer) -> None:
    urls = [http_server.url("/hold/red.jpg?secs=0.15")] * 6
    start = time.monotonic()
    with make_fetcher(per_host_connections=2) as f, ThreadPoolExecutor(6) as pool:
        results = list(pool.map(f.fetch, urls))
    assert all(r.status == Status.OK for r in results)
    assert http_server.max_in_flight == 2
    assert time.monotonic() - start >= 3 * 0.15


def test_close_releases_idle_connections(http_server: LoopbackServer) -> None:
    f = make_fetcher()
    assert f.fetch(http_server.url("/img/red.jpg")).status == Status.OK
    f.close()
    deadline = time.monotonic() + 2
    while http_server._open and time.monotonic() < deadline:  # server sees the close
        time.sleep(0.01)
    assert not http_server._open


# --------------------------------------------------------------------------- robustness


def test_no_exception_escapes(monkeypatch: pytest.MonkeyPatch, fetcher: Fetcher) -> None:
    def explode(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Fetcher, "_attempt", explode)
    result = fetcher.fetch("http://127.0.0.1:1/a.jpg")
    assert result.status == Status.DOWNLOAD_ERROR and "boom" in result.error


def test_concurrent_mixed_statuses(http_server: LoopbackServer) -> None:
    paths = ["/img/red.jpg", "/status/404", "/big?size=5000", "/robots/noai/red.jpg",
             "/chunked/blue.png", "/redirect-chain/1"] * 5
    expected = [Status.OK, Status.HTTP_ERROR, Status.TOO_LARGE, Status.OPTED_OUT,
                Status.OK, Status.OK] * 5
    with make_fetcher(max_bytes=4000) as f, ThreadPoolExecutor(6) as pool:
        results = list(pool.map(f.fetch, [http_server.url(p) for p in paths]))
    assert [r.status for r in results] == expected


# --------------------------------------------------------------------------- HTTPS


@pytest.fixture(scope="module")
def localhost_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for the name ``localhost`` only (no IP SAN)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl command not available")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True)
    return cert, key


@pytest.fixture
def https_server(image_dir: Path, localhost_cert: tuple[Path, Path]) -> Iterator[LoopbackServer]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*localhost_cert)
    with LoopbackServer(image_dir, "127.0.0.1", tls=context) as server:
        yield server


def loopback_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    # "localhost" may also resolve to ::1 (outside the allow-list): pin it to 127.0.0.1.
    install_fake_dns(monkeypatch, {"localhost": ["127.0.0.1"]})


def test_https_with_trusted_cert(monkeypatch: pytest.MonkeyPatch, https_server: LoopbackServer,
                                 localhost_cert: tuple[Path, Path], image_dir: Path) -> None:
    loopback_localhost(monkeypatch)
    trust = ssl.create_default_context(cafile=str(localhost_cert[0]))
    url = f"https://localhost:{https_server.port}/img/red.jpg"
    with Fetcher(loopback_download_config(), ssl_context=trust) as f:
        results = [f.fetch(url) for _ in range(3)]
    assert all(r.status == Status.OK for r in results)
    assert results[0].body == (image_dir / "red.jpg").read_bytes()
    assert https_server.connections == 1  # TLS connections are pooled too


def test_https_untrusted_cert_refused(monkeypatch: pytest.MonkeyPatch,
                                      https_server: LoopbackServer) -> None:
    loopback_localhost(monkeypatch)
    with make_fetcher() as f:
        result = f.fetch(f"https://localhost:{https_server.port}/img/red.jpg")
    assert result.status == Status.DOWNLOAD_ERROR and "certificate" in result.error.lower()
    assert https_server.requests_seen == 0


def test_tls_context_is_made_at_the_first_https_url(monkeypatch: pytest.MonkeyPatch,
                                                    http_server: LoopbackServer,
                                                    https_server: LoopbackServer) -> None:
    # Loading the CA store costs ~60 ms of CPU: a shard of http URLs never pays it.
    loopback_localhost(monkeypatch)
    with make_fetcher() as f:
        assert f.fetch(http_server.url("/img/red.jpg")).status == Status.OK
        assert f._ssl_context is None
        f.fetch(f"https://localhost:{https_server.port}/img/red.jpg")
        assert isinstance(f._ssl_context, ssl.SSLContext)


def test_https_hostname_checked(https_server: LoopbackServer,
                                localhost_cert: tuple[Path, Path]) -> None:
    # The certificate names localhost; asking for 127.0.0.1 must fail verification.
    trust = ssl.create_default_context(cafile=str(localhost_cert[0]))
    with Fetcher(loopback_download_config(), ssl_context=trust) as f:
        result = f.fetch(https_server.url("/img/red.jpg"))
    assert result.status == Status.DOWNLOAD_ERROR
    assert https_server.requests_seen == 0


def test_threads_share_one_fetcher_safely(http_server: LoopbackServer) -> None:
    errors: list[BaseException] = []
    with make_fetcher(per_host_connections=3) as f:
        def work() -> None:
            try:
                for _ in range(10):
                    assert f.fetch(http_server.url("/img/red.jpg")).status == Status.OK
            except BaseException as err:  # noqa: BLE001 - surfaced below
                errors.append(err)

        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == [] and http_server.requests_seen == 60
    assert http_server.connections <= 3
