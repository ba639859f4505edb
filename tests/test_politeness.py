"""Per-host politeness in stage 1 (download/politeness.py through download/fetch.py):
jittered backoff in 429 storms, the request-rate cap, and the circuit breaker, against a
loopback server whose request log (arrival times per path) is the evidence."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from loopback_server import LoopbackServer, make_images

from pairforge.backoff import full_jitter
from pairforge.config import DownloadConfig, parse_config
from pairforge.download.fetch import Fetcher
from pairforge.download.politeness import is_transient, merge_stats
from pairforge.download.shard import download_shard
from pairforge.pipeline.contract import shard_config
from pairforge.pipeline.download_stage import input_shards
from pairforge.pipeline.settings import settings_record, stage_settings
from pairforge.records import Status

HOST = "127.0.0.1"


class ScriptedServer(LoopbackServer):
    """The loopback server plus ``/storm/<id>``: 429 (no Retry-After) for the first
    ``storm`` requests of each id, then the image; ``/down/<id>``: 503 while ``down_for``
    requests of all ids have not been answered yet (forever by default), then the image.
    ``arrivals`` logs every request's arrival (monotonic time, path)."""

    def __init__(self, image_dir: Path) -> None:
        super().__init__(image_dir, HOST)
        self.storm = 3
        self.down_for = 10**9
        self.arrivals: list[tuple[float, str]] = []
        self._seen: dict[str, int] = {}
        self._log_lock = threading.Lock()

    def _record(self, path: str, headers: dict[str, str]) -> None:
        with self._log_lock:
            self.arrivals.append((time.monotonic(), path))
        super()._record(path, headers)

    def _count(self, key: str) -> int:
        with self._log_lock:
            self._seen[key] = self._seen.get(key, 0) + 1
            return self._seen[key]

    def _route_storm(self, handler, rest: str, query: dict[str, str]) -> None:  # noqa: ANN001
        if self._count(rest) <= self.storm:
            handler.send_body(429, b"slow down", "text/plain")
        else:
            self._send_image(handler, "red.jpg")

    def _route_down(self, handler, rest: str, query: dict[str, str]) -> None:  # noqa: ANN001
        if self._count("down") <= self.down_for:
            handler.send_body(503, b"unavailable", "text/plain")
        else:
            self._send_image(handler, "red.jpg")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    make_images(folder)
    return folder


@pytest.fixture
def server(images):
    with ScriptedServer(images) as srv:
        yield srv


def _fetcher(**download: Any) -> Fetcher:
    cfg = DownloadConfig(allow_addresses=[f"{HOST}/32"], robots_txt=False, tdm=False,
                         **download)
    return Fetcher(cfg)


def _fetch_all(fetcher: Fetcher, urls: list[str], threads: int = 1) -> list:
    with fetcher, ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fetcher.fetch, urls))


# --------------------------------------------------------------------------- pure parts


def test_full_jitter_stays_within_its_bound_and_spreads():
    rng = random.Random(0)
    delays = [full_jitter(0.5, 3, rng) for _ in range(2000)]
    assert min(delays) >= 0 and max(delays) <= 4.0
    assert 1.8 < sum(delays) / len(delays) < 2.2  # uniform on [0, 4]: mean 2
    assert len({round(d, 3) for d in delays}) > 1000  # not one shared delay


@pytest.mark.parametrize(("status", "http", "retryable", "expected"), [
    (Status.TIMEOUT, None, False, True), (Status.HTTP_ERROR, 503, True, True),
    (Status.HTTP_ERROR, 429, False, True), (Status.HTTP_ERROR, 404, False, False),
    (Status.DOWNLOAD_ERROR, None, True, True), (Status.DOWNLOAD_ERROR, None, False, False),
    (Status.OPTED_OUT, 200, False, False), (Status.OK, 200, False, False)])
def test_transient_outcomes(status, http, retryable, expected):
    assert is_transient(status, http, retryable) is expected


def test_part_stats_add_up_per_host():
    merged = merge_stats([{"a": {"backoffs": 2}, "b": {"throttled": 1}},
                          {"a": {"backoffs": 1, "breaker_opened": 1}}])
    assert merged == {"a": {"backoffs": 3, "breaker_opened": 1}, "b": {"throttled": 1}}


# ------------------------------------------------------------------------ 429 and rates


def test_a_429_storm_ends_ok_after_jittered_backoffs(server):
    urls = [server.url(f"/storm/{i}") for i in range(8)]
    fetcher = _fetcher(retries=4, backoff=0.02)
    results = _fetch_all(fetcher, urls, threads=4)
    assert [r.status for r in results] == [Status.OK] * 8
    assert all(server.hits(f"/storm/{i}") == 4 for i in range(8))  # 3 x 429, then 200
    assert fetcher.hosts.stats()[HOST]["backoffs"] == 24
    for i in range(8):  # the waits between one URL's tries: within the jittered bounds
        times = [t for t, p in server.arrivals if p == f"/storm/{i}"]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert all(gap <= 0.02 * 2**k + 0.25 for k, gap in enumerate(gaps))


def test_the_rate_cap_is_never_exceeded(server):
    rate, burst, n = 25.0, 2, 30
    fetcher = _fetcher(per_host_requests_per_s=rate, per_host_burst=burst)
    started = time.monotonic()
    results = _fetch_all(fetcher, [server.url("/img/red.jpg")] * n, threads=8)
    assert [r.status for r in results] == [Status.OK] * n
    times = sorted(t for t, p in server.arrivals)
    assert len(times) == n
    # any window of the log: at most the burst plus the rate times its length (requests
    # leave the client on schedule; the server logs them a little later, in any order:
    # 50 ms of scheduling delay allowed on a loaded machine; uncapped, all 30 arrive in
    # well under that)
    slack = 0.05
    for i in range(n):
        for j in range(i + 1, n):
            assert j - i + 1 <= burst + rate * (times[j] - times[i] + slack) + 1e-9
    assert time.monotonic() - started >= (n - burst) / rate - slack
    counts = fetcher.hosts.stats()[HOST]
    assert counts["throttled"] == n - burst and counts["throttled_ms"] > 0


# ------------------------------------------------------------------- the circuit breaker


def test_a_host_that_stays_down_is_paused_then_given_up(server):
    fetcher = _fetcher(retries=0, host_failures=3, host_pause_s=0.3, host_max_pauses=1)
    results = _fetch_all(fetcher, [server.url(f"/down/{i}") for i in range(20)])
    statuses = [r.status for r in results]
    # 3 failures open the breaker; after the pause one probe fails and it opens a second
    # time, past host_max_pauses: the other 16 rows end without a request
    assert statuses == [Status.HTTP_ERROR] * 4 + [Status.HOST_PAUSED] * 16
    times = [t for t, p in server.arrivals]
    assert len(times) == 4
    assert times[3] - times[2] >= 0.3  # no request while paused
    counts = fetcher.hosts.stats()[HOST]
    assert counts == {"breaker_opened": 2, "paused_ms": 300, "rows_host_paused": 16}
    assert "download.host_failures" in results[-1].error


def test_a_host_that_recovers_after_its_pause_serves_every_later_row(server):
    server.down_for = 3
    fetcher = _fetcher(retries=0, host_failures=3, host_pause_s=0.2, host_max_pauses=2)
    results = _fetch_all(fetcher, [server.url(f"/down/{i}") for i in range(10)])
    assert [r.status for r in results] == [Status.HTTP_ERROR] * 3 + [Status.OK] * 7
    times = [t for t, p in server.arrivals]
    assert len(times) == 10 and times[3] - times[2] >= 0.2
    assert fetcher.hosts.stats()[HOST] == {"breaker_opened": 1, "paused_ms": 200}


def test_answers_that_are_not_transient_keep_the_breaker_closed(server):
    server.down_for = 3
    fetcher = _fetcher(retries=0, host_failures=3, host_pause_s=0.2, host_max_pauses=0)
    # 404s between failures: the host answers, so it is never paused
    urls = [server.url(p) for p in ["/down/0", "/down/1", "/status/404"] * 3]
    results = _fetch_all(fetcher, urls)
    assert [r.status for r in results].count(Status.HOST_PAUSED) == 0
    assert fetcher.hosts.stats() == {}


def test_the_breaker_is_off_by_default(server):
    fetcher = _fetcher(retries=0)
    results = _fetch_all(fetcher, [server.url(f"/down/{i}") for i in range(12)], threads=4)
    assert [r.status for r in results] == [Status.HTTP_ERROR] * 12
    assert len(server.arrivals) == 12


def test_host_paused_rows_and_counts_reach_the_shard(tmp_path, server):
    urls = [server.url("/img/red.jpg")] + [server.url(f"/down/{i}") for i in range(6)]
    (tmp_path / "in.csv").write_text("url,caption\n" + "".join(
        f"{u},a red square\n" for u in urls))
    cfg = parse_config({
        "input": {"path": str(tmp_path / "in.csv"), "shard_size": 100},
        "output": {"path": str(tmp_path / "out")},
        "download": {"threads": 1, "retries": 0, "allow_addresses": [f"{HOST}/32"],
                     "robots_txt": False, "tdm": False, "host_failures": 2,
                     "host_pause_s": 0.1, "host_max_pauses": 0}})
    with input_shards(cfg) as shards:
        stats = download_shard(shards[0], shard_config(cfg),
                               settings_record(stage_settings(cfg, "download")))
    rows = pq.read_table(tmp_path / "out" / "raw" / "00000.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "http_error", "http_error"] + ["host_paused"] * 4
    assert stats["status"] == {"ok": 1, "http_error": 2, "host_paused": 4}
    assert stats["politeness"] == {HOST: {"breaker_opened": 1, "rows_host_paused": 4}}


def test_many_threads_on_a_down_host_wait_out_the_pause_together(server):
    fetcher = _fetcher(retries=0, host_failures=3, host_pause_s=0.3, host_max_pauses=1)
    results = _fetch_all(fetcher, [server.url(f"/down/{i}") for i in range(40)], threads=8)
    times = sorted(t for t, p in server.arrivals)
    # at most the rows in flight when the breaker opened, then one probe
    assert len(times) <= 3 + 7 + 1
    # the pause: requests in flight when it began may reach the server a little later
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) >= 0.25
    statuses = [r.status for r in results]
    assert statuses.count(Status.HTTP_ERROR) == len(times)
    assert statuses.count(Status.HOST_PAUSED) == 40 - len(times)
