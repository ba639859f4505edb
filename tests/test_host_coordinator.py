"""Stage 1's run-wide politeness (issue 52): the host coordinator's lease arithmetic
(download/host_coordinator.py), tasks sharing one rate, connection budget and breaker
through it (download/host_leases.py, politeness.py), and a stage-1 run on Ray whose hosts
have rows in several shards (download/host_actors.py): the loopback server's request log
is the evidence."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from loopback_server import LoopbackServer, make_images

from pairforge.config import DownloadConfig
from pairforge.download.fetch import Fetcher
from pairforge.download.host_coordinator import FileStore, HostBook, Limits, shard_of
from pairforge.download.host_leases import LocalLink
from pairforge.download.politeness import HostPolicy
from pairforge.records import Status

HOST = "127.0.0.1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _limits(rate: float | None = 20.0, connections: int = 8, failures: int | None = 3,
            max_pauses: int = 2) -> Limits:
    return Limits(rate, 1.0, connections, failures, 10.0, max_pauses)


def _ask(book: HostBook, task: str, host: str = "h", **report: Any) -> dict[str, Any]:
    (grant,) = book.exchange(task, [{"host": host, **report}])
    return grant


# ----------------------------------------------------------------------- lease arithmetic


def test_a_newcomer_gets_only_what_live_leases_leave_until_they_renew():
    clock = Clock()
    book = HostBook(_limits(), lease_s=2.0, clock=clock)
    assert (_ask(book, "a")["rate"], _ask(book, "a")["connections"]) == (20.0, 8)
    b = _ask(book, "b")
    assert (b["rate"], b["connections"]) == (0.0, 0)  # a's lease still holds it all
    clock.now += 1.0
    a = _ask(book, "a")  # a renews: the equal share
    assert (a["rate"], a["connections"], a["burst"]) == (10.0, 4, 0.5)
    b = _ask(book, "b")
    assert (b["rate"], b["connections"], b["burst"]) == (10.0, 4, 0.5)
    c = _ask(book, "c")
    assert (c["rate"], c["connections"]) == (0.0, 0)
    for task in "abc":  # a round of renewals: thirds in whole units, never over the rate
        _ask(book, task)
    grants = [_ask(book, task) for task in "abc"]
    assert [g["rate"] for g in grants] == [7.0, 7.0, 6.0]
    assert [g["connections"] for g in grants] == [3, 3, 2]
    assert sum(h.rate for h in book.hosts["h"].holders.values()) <= 20.0 + 1e-9


def test_requests_and_connections_rotate_when_holders_outnumber_them():
    clock = Clock()
    book = HostBook(_limits(rate=2.0, connections=2), lease_s=2.0, clock=clock)
    connections: Counter[str] = Counter()
    rate: Counter[str] = Counter()
    for _ in range(6):  # rounds of renewals, each task once a round
        clock.now += 0.5
        for task in "abcd":
            grant = _ask(book, task)
            connections[task] += grant["connections"]
            rate[task] += grant["rate"]
            holders = book.hosts["h"].holders.values()
            assert sum(h.connections for h in holders) <= 2
            assert sum(h.rate for h in holders) <= 2.0
    assert min(connections[t] for t in "abcd") >= 2 and min(rate[t] for t in "abcd") >= 2


def test_a_released_or_lapsed_lease_frees_its_share_and_idle_hosts_go():
    clock = Clock()
    book = HostBook(_limits(), lease_s=2.0, clock=clock)
    _ask(book, "a")
    book.exchange("a", [{"host": "h", "release": True}])
    assert _ask(book, "b")["rate"] == 20.0  # released: all of it at once
    clock.now += 2.5  # b's lease lapsed (its task died): nothing held, the host forgotten
    book.exchange("c", [{"host": "other"}])
    assert set(book.hosts) == {"other"}
    assert _ask(book, "c")["rate"] == 20.0


def test_a_crawl_delay_host_is_sent_to_by_one_turn_at_a_time_a_delay_apart():
    """Crawl-delay 0.5 s under a cap of 20/s: one holder at a time at 2/s with no burst;
    the next turn is set a lease before the current ends and begins a delay after it; a
    holder that lets go ends its turn there; a sole holder's turn is extended with no gap."""
    clock = Clock()
    book = HostBook(_limits(), lease_s=2.0, clock=clock)

    def renew(*tasks: str) -> list[dict[str, Any]]:  # a second later, as holders do
        clock.now += 1.0
        return [_ask(book, task, spacing=0.5) for task in tasks]

    a = _ask(book, "a", spacing=0.5)
    assert (a["rate"], a["burst"], a["turn"], a["starts_in"], a["ends_in"]) == (
        2.0, 1.0, 1, 0.0, 8.0)
    b = _ask(book, "b", spacing=0.5)
    assert (b["rate"], "turn" in b) == (0.0, False)  # a's turn: b waits
    for _ in range(5):
        assert "turn" not in renew("b", "a")[0]
    b, a = renew("b", "a")  # at 106 a's turn ends within a lease: b's is set
    assert (b["rate"], b["turn"], b["starts_in"], b["ends_in"]) == (2.0, 2, 2.5, 10.5)
    assert (a["turn"], a["ends_in"]) == (1, 2.0)  # not extended: b is next
    for _ in range(4):  # b's turn (108.5 .. 116.5); a waits for the one after
        b, a = renew("b", "a")
    assert (b["turn"], "turn" in a) == (2, False)
    book.exchange("b", [{"host": "h", "release": True}])  # b lets go at 110
    a = _ask(book, "a", spacing=0.5)
    assert (a["turn"], a["starts_in"], a["ends_in"]) == (3, 0.5, 8.5)  # a delay after
    for _ in range(10):  # a alone: its turn is extended, with no gap
        (a,) = renew("a")
        assert (a["turn"], a["starts_in"] == 0.0, a["ends_in"] > 1.0) == (3, True, True)
    book.exchange("a", [{"host": "h", "release": True}])
    clock.now += 0.2  # nobody holds it, yet the host stays until a delay has passed
    assert _ask(book, "c", spacing=0.5)["starts_in"] == pytest.approx(0.3)


def test_a_crawl_delay_slower_than_the_cap_and_a_cap_slower_than_the_delay():
    book = HostBook(_limits(rate=1.0), clock=Clock())
    assert (_ask(book, "a", spacing=0.5)["rate"], _ask(book, "a")["burst"]) == (1.0, 1.0)
    book = HostBook(_limits(rate=None), clock=Clock())
    assert _ask(book, "a", spacing=4.0)["rate"] == 0.25


def test_no_cap_grants_no_rate_and_still_divides_connections():
    book = HostBook(_limits(rate=None), clock=Clock())
    a = _ask(book, "a")
    assert a["rate"] is None and a["connections"] == 8


def test_failures_add_up_across_tasks_and_the_opening_pauses_every_holder():
    clock = Clock()
    book = HostBook(_limits(failures=3), lease_s=2.0, clock=clock)
    assert _ask(book, "a", failures=2)["opened"] == 0
    b = _ask(book, "b", failures=1)  # a's two and b's one: three in a row
    assert (b["opened"], b["counted"], b["pause_left"]) == (1, True, 10.0)
    clock.now += 1.0
    a = _ask(book, "a")
    assert (a["opened"], a["counted"], a["pause_left"]) == (1, False, 9.0)


def test_a_success_resets_the_count_and_an_opening_is_counted_once():
    clock = Clock()
    book = HostBook(_limits(failures=3, max_pauses=1), lease_s=2.0, clock=clock)
    _ask(book, "a", failures=2)
    assert _ask(book, "b", failures=1, success=True)["opened"] == 0  # b's success first
    assert _ask(book, "a", opened=1)["counted"] is True  # a's own count opened it
    assert _ask(book, "b", opened=1)["counted"] is False  # b's too: the same opening
    clock.now += 11.0
    second = _ask(book, "b", opened=2)  # a probe failed: past host_max_pauses
    assert (second["counted"], second["given_up"]) == (True, True)
    assert _ask(book, "c")["given_up"] is True  # a task coming later learns it too
    clock.now += 3.0  # no lease live: the given-up host is still remembered
    assert _ask(book, "d")["given_up"] is True


def test_a_release_carries_the_tasks_last_opening():
    book = HostBook(_limits(failures=3), lease_s=2.0, clock=Clock())
    _ask(book, "a")
    (last,) = book.exchange("a", [{"host": "h", "release": True, "opened": 1}])
    assert (last["released"], last["counted"], last["opened"]) == (True, True, 1)
    assert book.hosts["h"].holders == {}
    assert _ask(book, "b")["pause_left"] == 10.0  # the host stays paused for the others


def test_the_hash_of_a_host_is_the_same_in_every_process():
    assert shard_of("example.com", 4) == 1  # crc32, not the salted hash()
    assert {shard_of(f"h{i}.org", 4) for i in range(40)} == {0, 1, 2, 3}


def test_the_file_store_has_one_fetcher_per_key_and_stays_within_its_bytes():
    clock = Clock()
    files = FileStore(max_bytes=3000, claim_s=5.0, clock=clock)
    assert files.get("k", 3600) == ("fetch", None)
    assert files.get("k", 3600) == ("wait", None)
    entry = {"outcome": "ok", "fetched_at": time.time(), "text": "User-agent: *\n"}
    files.put("k", entry)
    assert files.get("k", 3600) == ("hit", entry)
    assert files.get("gone", 3600) == ("fetch", None)
    clock.now += 6.0  # its fetcher died: the claim lapsed, another task fetches it
    assert files.get("gone", 3600) == ("fetch", None)
    for i in range(20):
        files.put(f"big{i}", {**entry, "text": "x" * 500})
    assert files.bytes <= 3000 and files.get("k", 3600)[0] == "fetch"  # least recent went


# ------------------------------------------------------- tasks through one coordinator


class CountingServer(LoopbackServer):
    """``/n/<id>``: an image; ``/down/<id>``: 503. ``arrivals``: each request's time."""

    def __init__(self, image_dir: Path, host: str = HOST) -> None:
        super().__init__(image_dir, host)
        self.arrivals: list[tuple[float, str]] = []
        self._log_lock = threading.Lock()

    def _record(self, path: str, headers: dict[str, str]) -> None:
        with self._log_lock:
            self.arrivals.append((time.monotonic(), path))
        super()._record(path, headers)

    def _route_n(self, handler, rest: str, query: dict[str, str]) -> None:  # noqa: ANN001
        self._send_image(handler, "red.jpg")

    def _route_down(self, handler, rest: str, query: dict[str, str]) -> None:  # noqa: ANN001
        handler.send_body(503, b"unavailable", "text/plain")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    make_images(folder)
    return folder


@pytest.fixture
def server(images):
    with CountingServer(images) as srv:
        yield srv


def _cfg(**download: Any) -> DownloadConfig:
    return DownloadConfig(allow_addresses=[f"{HOST}/32"], robots_txt=False, tdm=False,
                          retries=0, **download)


def _tasks(link: LocalLink, cfg: DownloadConfig, urls: list[list[str]],
           threads: int = 4) -> list[Fetcher]:
    """Each list of URLs fetched by a fetcher of its own (a task), all at once."""
    fetchers = [Fetcher(cfg, hosts=HostPolicy(cfg, link)) for _ in urls]
    results: list[list[Any]] = [[] for _ in urls]

    def run(i: int) -> None:
        with ThreadPoolExecutor(threads) as pool:
            results[i] = list(pool.map(fetchers[i].fetch, urls[i]))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(urls))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for fetcher in fetchers:
        fetcher.close()
    for fetcher, got in zip(fetchers, results, strict=True):
        fetcher.results = got  # type: ignore[attr-defined]
    return fetchers


def _wait_for(condition, seconds: float = 10.0) -> None:
    """Until ``condition()`` holds (a report the background thread sends); fail after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def _per_second(arrivals: list[tuple[float, str]]) -> list[int]:
    """Requests per 1-s window from the first arrival."""
    first = min(t for t, _ in arrivals)
    counts = Counter(int(t - first) for t, _ in arrivals)
    return [counts[i] for i in range(max(counts) + 1)]


def test_three_tasks_share_one_rate(server):
    cfg = _cfg(per_host_requests_per_s=10.0, threads=4)
    link = LocalLink(Limits.of(cfg))
    urls = [[server.url(f"/n/{t}-{i}") for i in range(10)] for t in range(3)]
    fetchers = _tasks(link, cfg, urls)
    assert all(r.status == Status.OK for f in fetchers for r in f.results)
    assert server.requests_seen == 30
    # three tasks each allowed 10/s alone would send 30 a second; together: 10 (+10 %)
    assert max(_per_second(server.arrivals)) <= 11
    assert sum(f.hosts.stats()[HOST]["throttled"] for f in fetchers) >= 25


def test_tasks_share_one_connection_budget(server):
    cfg = _cfg(per_host_connections=2)
    link = LocalLink(Limits.of(cfg))
    urls = [[server.url("/hold/red.jpg?secs=0.05")] * 8 for t in range(3)]
    fetchers = _tasks(link, cfg, urls)
    assert all(r.status == Status.OK for f in fetchers for r in f.results)
    assert server.max_in_flight <= 2  # three tasks of 4 threads each, 2 at once in all


def test_a_breaker_opened_by_one_task_pauses_the_host_for_the_others(server):
    cfg = _cfg(host_failures=3, host_pause_s=30.0, host_max_pauses=0)
    link = LocalLink(Limits.of(cfg))
    first = Fetcher(cfg, hosts=HostPolicy(cfg, link))
    with ThreadPoolExecutor(1) as pool:  # one row at a time: exactly 3 requests
        statuses = [r.status for r in pool.map(first.fetch, [server.url(f"/down/{i}")
                                                             for i in range(5)])]
    assert statuses == [Status.HTTP_ERROR] * 3 + [Status.HOST_PAUSED] * 2
    _wait_for(lambda: link.books[shard_of(HOST, 2)].hosts[HOST].given_up)  # reported
    second = Fetcher(cfg, hosts=HostPolicy(cfg, link))  # another task, rows that would work
    results = [second.fetch(server.url(f"/n/{i}")) for i in range(4)]
    first.close()
    second.close()
    assert [r.status for r in results] == [Status.HOST_PAUSED] * 4
    assert server.requests_seen == 3  # none of the second task's rows was requested
    assert first.hosts.stats()[HOST] == {"breaker_opened": 1, "rows_host_paused": 2}
    assert second.hosts.stats()[HOST] == {"rows_host_paused": 4}  # the opening once


def test_a_coordinator_that_does_not_answer_leaves_the_per_task_rule(server, caplog):
    cfg = _cfg(per_host_requests_per_s=50.0)
    link = LocalLink(Limits.of(cfg))
    link.down = {0, 1}
    (fetcher,) = _tasks(link, cfg, [[server.url(f"/n/{i}") for i in range(6)]])
    assert [r.status for r in fetcher.results] == [Status.OK] * 6
    assert fetcher.hosts.stats()[HOST]["coordinator_fallback"] == 1
    assert "per-task rule" in caplog.text


class MalformedLink(LocalLink):
    """Grants without their fields: the lease thread's own code fails on them."""

    def exchange_all(self, task, asks):  # noqa: ANN001, ANN201
        return {shard: [{"host": a["host"]} for a in batch] for shard, batch in asks.items()}


def test_a_lease_thread_that_fails_leaves_the_per_task_rule_not_a_hang(server, caplog):
    cfg = _cfg(per_host_requests_per_s=50.0, host_failures=5)
    (fetcher,) = _tasks(MalformedLink(Limits.of(cfg)), cfg,
                        [[server.url(f"/n/{i}") for i in range(4)]])
    assert [r.status for r in fetcher.results] == [Status.OK] * 4
    assert "per-task rule from now on" in caplog.text


class CountingLink(LocalLink):
    def __init__(self, limits: Limits) -> None:
        super().__init__(limits, shards=1)
        self.calls: list[int] = []  # hosts per call

    def exchange_all(self, task, asks):  # noqa: ANN001, ANN201
        self.calls.append(sum(len(batch) for batch in asks.values()))
        return super().exchange_all(task, asks)


def test_a_tasks_renewals_fall_together_into_one_call_per_half_lease():
    """Eight hosts first used 0.15 s apart, then used without pause for 4 s (two lease
    lives): after their first grants, renewals ride along with the first that is due, so
    the task calls its coordinator about twice a lease, not once per host per half lease
    (each host first used at its own moment made the thread call on nearly every tick:
    ~4 % of stage 1's CPU, bench/download.py with 16 hosts)."""
    from pairforge.download.host_coordinator import LEASE_S
    from pairforge.download.host_leases import HostLeases

    link = CountingLink(Limits(20.0, 1.0, 8, None, 10.0, 2))
    changed = threading.Condition()
    leases = HostLeases(link, changed, lambda *_: None, lambda _: None, lambda *_: None)
    hosts = [f"h{i}" for i in range(8)]
    try:
        for i, host in enumerate(hosts):
            with changed:
                leases.current(host)
            time.sleep(0.15 if i < len(hosts) - 1 else 0)
        firsts = len(link.calls)
        end = time.monotonic() + 2 * LEASE_S
        while time.monotonic() < end:
            with changed:
                for host in hosts:
                    leases.current(host)  # in use: kept and renewed
            time.sleep(0.05)
        renewals = link.calls[firsts:]
    finally:
        leases.close()
    # apart: 8 hosts x 4 half-leases = 32 calls of one host; together: ~4 calls of 8
    assert len(renewals) <= 8, link.calls
    assert sum(renewals) >= 3 * len(hosts)  # every host was still renewed, each time


def test_nodes_of_a_run_fetch_each_policy_file_once_through_the_coordinator(tmp_path, server):
    """Two gates with node caches of their own (two nodes) and one coordinator: robots.txt
    and tdmrep.json are requested once; the second node's gate fetched nothing."""
    from pairforge.download.consent import ConsentGate

    cfg = DownloadConfig(allow_addresses=[f"{HOST}/32"], timeout=2.0)
    link = LocalLink(Limits.of(cfg))
    origin = ("http", HOST, server.port)
    gates = [ConsentGate(cfg, tmp_path / f"node{i}", link=link) for i in range(2)]
    try:
        assert all(g.admit(server.url("/n/1"), origin) is None for g in gates)
    finally:
        for gate in gates:
            gate.close()
    assert (server.hits("/robots.txt"), server.hits("/.well-known/tdmrep.json")) == (1, 1)
    assert [g.stats()["fetched"] for g in gates] == [
        {"/robots.txt": 1, "/.well-known/tdmrep.json": 1}, {}]


def test_a_crawl_delay_spaces_the_requests_of_every_node(tmp_path, images):
    """robots.txt asks for 0.2 s between requests; two tasks on two nodes (node caches of
    their own, so no shared spacing file): the coordinator makes the delay the host's rate
    for the run, and the server sees the requests of both 0.2 s apart."""
    from pairforge.download.consent import ConsentGate

    class Polite(CountingServer):
        def _route_robots_txt(self, handler, rest, query) -> None:  # noqa: ANN001
            handler.send_body(200, b"User-agent: *\nCrawl-delay: 0.2\n", "text/plain")

    cfg = DownloadConfig(allow_addresses=[f"{HOST}/32"], tdm=False, retries=0)
    link = LocalLink(Limits.of(cfg))
    with Polite(images) as server:
        gates = [ConsentGate(cfg, tmp_path / f"node{i}", link=link) for i in range(2)]
        fetchers = [Fetcher(cfg, gate=g, hosts=HostPolicy(cfg, link)) for g in gates]
        urls = [server.url(f"/n/{t}-{i}") for t in range(2) for i in range(8)]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda u: fetchers[int(u.rsplit("/", 1)[1][0])].fetch(u),
                                    urls))
        for fetcher, gate in zip(fetchers, gates, strict=True):
            fetcher.close()
            gate.close()
    assert [r.status for r in results] == [Status.OK] * 16
    times = sorted(t for t, p in server.arrivals if p.startswith("/n/"))
    # the client spaces the sends; 30 ms covers scheduling between send and arrival
    assert min(b - a for a, b in zip(times, times[1:], strict=False)) >= 0.2 - 0.03


# ------------------------------------------------------------- stage 1 on Ray, run-wide


def _stage1_config(tmp_path: Path, urls: list[str], shard_size: int, **download: Any):
    from pairforge.config import parse_config

    (tmp_path / "in.csv").write_text("url,caption\n" + "".join(
        f"{u},photo {i}\n" for i, u in enumerate(urls)))
    return parse_config({
        "input": {"path": str(tmp_path / "in.csv"), "shard_size": shard_size},
        "output": {"path": str(tmp_path / "out")},
        "download": {"threads": 4, "timeout": 5.0, "retries": 0, "processes": 2,
                     "allow_addresses": ["127.0.0.1/32", "127.0.0.2/32"],
                     "image": {"image_size": 32}, **download}})


def _stage1(cfg) -> dict[str, Any]:
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    return run_download(cfg, RunOptions(show_progress=False))


def _shard_stats(tmp_path: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(f.read_text())
            for f in sorted((tmp_path / "out" / "raw").glob("*_stats.json"))]


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [row for f in sorted((tmp_path / "out" / "raw").glob("*.parquet"))
            for row in pq.read_table(f).to_pylist()]


def test_stage1_tasks_share_each_hosts_rate_and_fetch_robots_once(tmp_path, images, server,
                                                                   ray_local):
    """One host's 36 rows and another's 12 spread over 8 shards, two tasks at once, a cap
    of 10/s: the server sees at most 11 a second, and each origin's robots.txt and
    tdmrep.json are requested once for the run."""
    with CountingServer(images, "127.0.0.2") as other:
        urls = [(server.url(f"/n/{i}") if i % 4 else other.url(f"/n/{i}")) for i in range(48)]
        summary = _stage1(_stage1_config(tmp_path, urls, 6, per_host_requests_per_s=10.0))
        assert (other.hits("/robots.txt"), other.hits("/.well-known/tdmrep.json")) == (1, 1)
    assert summary["status"] == {"ok": 48}
    assert (server.hits("/robots.txt"), server.hits("/.well-known/tdmrep.json")) == (1, 1)
    images_seen = [t for t, p in server.arrivals if p.startswith("/n/")]
    assert len(images_seen) == 36 == len({p for _, p in server.arrivals if p.startswith("/n/")})
    # eight tasks each allowed 10/s alone: two at once sent ~20 a second before issue 52
    assert max(_per_second([(t, "") for t in images_seen])) <= 11
    stats = _shard_stats(tmp_path)
    assert len(stats) == 8
    assert sum(s["consent"]["fetched"].get("/robots.txt", 0) for s in stats) == 2


def test_stage1_a_breaker_opened_in_one_task_pauses_the_host_in_the_others(
        tmp_path, images, server, ray_local):
    """Shard 0's rows of a host fail, shard 1's would be served (slowly: 3/s for the two
    tasks): once shard 0's task opens the breaker, the host is given up for both, each row
    ends with a status, and the opening is counted once."""
    urls = [server.url(f"/down/{i}") for i in range(5)] + [
        server.url(f"/n/{i}") for i in range(25)]
    cfg = _stage1_config(tmp_path, urls, 5, host_failures=3, host_pause_s=60.0,
                         host_max_pauses=0, per_host_requests_per_s=3.0, threads=1,
                         robots_txt=False, tdm=False)
    cfg.input.shard_size = 5  # shard 0: the failing rows; shards 1-5 the others
    summary = _stage1(cfg)
    rows = _rows(tmp_path)
    assert len(rows) == 30 and all(r["status"] for r in rows)
    failing = [r for r in rows if "/down/" in r["url"]]
    assert [r["status"] for r in failing] == ["http_error"] * 3 + ["host_paused"] * 2
    served = [r for r in rows if "/n/" in r["url"]]
    paused = [r for r in served if r["status"] == "host_paused"]
    assert len(paused) >= 10  # shards 1-5 would take 8 s at 3/s: the pause reached them
    assert {r["status"] for r in served} <= {"ok", "host_paused"}
    assert server.hits("/n") == 0 and len({p for _, p in server.arrivals}) == len(
        server.arrivals)  # no row requested twice
    assert len(server.arrivals) == 3 + len(served) - len(paused)
    stats = _shard_stats(tmp_path)
    assert sum(s["politeness"].get(HOST, {}).get("breaker_opened", 0) for s in stats) == 1
    assert sum(s["politeness"].get(HOST, {}).get("rows_host_paused", 0)
               for s in stats) == summary["status"]["host_paused"] == 2 + len(paused)


def test_stage1_a_coordinator_killed_mid_run_loses_no_row(tmp_path, images, server,
                                                          ray_local):
    """The run's coordinator is killed for good once the server has seen 8 requests: the
    tasks make it again (the per-task rule covers any gap), every row ends ok, each
    requested once, and the stage removes the coordinator at the end."""
    import ray

    from pairforge.download.host_actors import NAMESPACE

    def coordinators() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NAMESPACE}

    before = coordinators()
    urls = [server.url(f"/n/{i}") for i in range(64)]
    cfg = _stage1_config(tmp_path, urls, 8, per_host_requests_per_s=8.0, robots_txt=False,
                         tdm=False)
    done: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: done.update(summary=_stage1(cfg)))
    runner.start()
    _wait_for(lambda: len(server.arrivals) >= 8, 60)
    (name,) = coordinators() - before
    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    killed_at = len(server.arrivals)
    _wait_for(lambda: name not in coordinators(), 30)  # dead
    _wait_for(lambda: name in coordinators() or not runner.is_alive(), 60)
    made_again_at = len(server.arrivals)
    runner.join(120)
    assert done["summary"]["status"] == {"ok": 64}
    assert killed_at <= made_again_at < 64  # killed, then made again, both mid-run
    assert sorted(p for _, p in server.arrivals) == sorted(f"/n/{i}" for i in range(64))
    assert len(_rows(tmp_path)) == 64
    assert name not in coordinators()  # the stage removed it at the end
