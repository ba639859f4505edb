"""Per-host politeness of stage 1: a request-rate cap, a connection budget, jittered
backoff and a circuit breaker, with their counts per host.

In a stage-1 run on Ray these hold **per host for the whole run**: every shard task on
every node takes leases of its hosts from the run's host coordinators
(``download/host_coordinator.py``, ``host_leases.py``, ``host_actors.py``), which divide
each host's rate and connections among the tasks holding its rows and keep one breaker
per host. A ``HostPolicy`` without coordinators (a task run on its own, the service's
URL fetches), and a task whose coordinator stopped answering (until it answers again;
the log says so), applies the same settings to itself alone: the **per-task rule**.

* **Rate cap** (``download.per_host_requests_per_s``, ``download.per_host_burst``): a token
  bucket per host; every request takes a token, retries and redirect hops included, and
  waits for one when the bucket is empty. Under a lease the bucket fills at the task's
  share of the rate and holds its share of the burst (at least one request), so the
  tasks together stay within the rate; a waiting request re-reads the share, so a share
  that shrinks applies at once. It sits beside the connection budget
  (``per_host_connections``, divided the same way in whole connections) and robots.txt's
  Crawl-delay (``download/consent.py``): a request waits for all three. Under a lease the
  Crawl-delay is the coordinator's: the host's holders send by turns, one at a time at
  one request per delay (``host_coordinator.py``); under the per-task rule the gate keeps
  it per node.
* **Backoff** on 429/5xx and refused or cut connections without Retry-After: "full
  jitter", a uniform delay in [0, ``backoff`` x 2^attempt] (``pairforge/backoff.py``, the
  one backoff rule), so the threads and tasks that failed together do not come back
  together (Retry-After, when sent, is obeyed as is). The fetcher counts each per host here.
* **Circuit breaker** (``download.host_failures``, ``download.host_pause_s``,
  ``download.host_max_pauses``): after ``host_failures`` rows in a row of one host end in a
  transient failure (timeout, connection, 429, 5xx), the host is paused for
  ``host_pause_s``. Rows of a paused host wait for the pause to end; then one of them
  probes the host (the task's other rows wait for its answer): a success closes the
  breaker, a transient failure opens it again for twice as long. After
  ``host_max_pauses`` openings the host is given up: its remaining rows end
  ``host_paused`` without a request, as do the rows that were waiting. Everything else
  (404, an opt-out, a body that is not an image) shows the host is up and resets its
  count. Under leases the failures of all tasks add up, an opening made by one task
  pauses the host for all within half a lease, and each opening is counted once in the
  stats (``breaker_opened``, ``paused_ms``: by the task whose report made it).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from pairforge.config import DownloadConfig
from pairforge.download.host_leases import FALLBACK, CoordinatorLink, HostLeases
from pairforge.records import Status


class HostGivenUp(Exception):
    """The host's breaker opened ``host_max_pauses`` times: no more requests to it."""


def is_transient(status: Status | str, http_status: int | None, retryable: bool) -> bool:
    """Whether an outcome says the host is struggling rather than answering: a timeout, a
    connection failure that may pass, or a 429/5xx."""
    if status == Status.TIMEOUT:
        return True
    if status == Status.HTTP_ERROR:
        return http_status is not None and (http_status == 429 or http_status >= 500)
    return status == Status.DOWNLOAD_ERROR and retryable


class _Breaker:
    __slots__ = ("failures", "opened", "paused_until", "probing", "given_up")

    def __init__(self) -> None:
        self.failures = 0  # transient failures in a row
        self.opened = 0  # times opened
        self.paused_until = 0.0
        self.probing = False
        self.given_up = False


class _Limits(NamedTuple):
    rate: float | None
    burst: float  # what the bucket may hold
    start: float  # what a new bucket holds
    connections: int


class HostPolicy:
    """The rate cap, connection budget and circuit breaker of one fetcher's hosts;
    thread-safe. ``link``: the run's host coordinators (None: the per-task rule)."""

    def __init__(self, cfg: DownloadConfig, link: CoordinatorLink | None = None) -> None:
        self.rate = cfg.per_host_requests_per_s
        self.burst = float(cfg.per_host_burst)
        self.connections = cfg.per_host_connections
        self.failures = cfg.host_failures
        self.pause_s = cfg.host_pause_s
        self.max_pauses = cfg.host_max_pauses
        self._own = _Limits(self.rate, self.burst, self.burst, self.connections)
        self._tokens: dict[str, tuple[float, float]] = {}  # host: (tokens, at)
        self._turns: dict[str, int] = {}  # host: the Crawl-delay turn its bucket is in
        self._in_use: Counter[str] = Counter()  # requests in flight per host
        self._breakers: dict[str, _Breaker] = defaultdict(_Breaker)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.leases = (HostLeases(link, self._changed, self._granted, self._fell_back,
                                  self._unsent_open) if link is not None else None)

    def close(self) -> None:
        """Give the leases back (a no-op under the per-task rule)."""
        if self.leases is not None:
            self.leases.close()

    def _limits(self, host: str) -> _Limits | None:
        """The host's limits for this task now; None: wait for its first grant."""
        if self.leases is None:
            return self._own
        grant = self.leases.current(host)
        if grant is FALLBACK:
            return self._own
        if grant is None:
            return None
        assert isinstance(grant, dict)
        share = grant["burst"]
        return _Limits(grant["rate"], max(1.0, share), share, grant["connections"])

    # the rate cap ---------------------------------------------------------------------

    def take_token(self, host: str, spacing: float = 0.0) -> bool:
        """Wait until ``host``'s bucket holds a token, and take it. The wait re-reads the
        host's share each time round: a share that shrank applies to waiting requests.
        ``spacing``: robots.txt's Crawl-delay for the host (seconds between requests).
        True when the host's run-wide rate took the spacing in (its coordinator divides
        the slower of the cap and the spacing); False: the gate keeps the spacing itself
        (per node, ``consent.ConsentGate.pace``)."""
        if self.rate is None and spacing <= 0:
            return False
        started, waited = time.monotonic(), False
        with self._changed:
            if spacing > 0 and self.leases is not None:
                self.leases.spacing(host, spacing)
            while True:
                limits = self._limits(host)
                now = time.monotonic()
                if limits is None:
                    self._changed.wait(0.1)
                    waited = True
                    continue
                if limits.rate is None:  # no cap, and no spacing the coordinator knows
                    return False
                rate = limits.rate
                tokens, at = self._tokens.get(host, (limits.start, now))
                tokens = min(limits.burst, tokens + (now - at) * rate)
                if tokens >= 1.0:
                    self._tokens[host] = (tokens - 1.0, now)
                    break
                self._tokens[host] = (tokens, now)
                self._changed.wait(min((1.0 - tokens) / rate, 0.1) if rate > 0 else 0.1)
                waited = True
            if waited:
                self.counts[host]["throttled"] += 1
                self.counts[host]["throttled_ms"] += round((now - started) * 1000)
            return limits is not self._own

    # the connection budget ------------------------------------------------------------

    @contextmanager
    def slot(self, host: str) -> Iterator[None]:
        """Hold one of ``host``'s connections for this task while the block runs."""
        with self._changed:
            while True:
                limits = self._limits(host)
                if limits is not None and self._in_use[host] < limits.connections:
                    break
                self._changed.wait(0.1)
            self._in_use[host] += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_use[host] -= 1
                if not self._in_use[host]:
                    del self._in_use[host]
                if self.leases is not None:
                    self.leases.current(host)  # in use until now: the lease is kept
                self._changed.notify_all()

    # the breaker ----------------------------------------------------------------------

    def enter(self, host: str) -> bool:
        """Wait while ``host`` is paused or probed by another row; raise HostGivenUp when
        it was given up. On return the row may request; True: as the probe of a breaker
        whose pause just ended (pass it to :meth:`record`)."""
        if self.failures is None:
            return False
        with self._changed:
            while self.leases is not None and self._limits(host) is None:
                self._changed.wait(0.1)  # the first grant says whether others opened it
            breaker = self._breakers[host]
            while True:
                if breaker.given_up:
                    raise HostGivenUp(host)
                now = time.monotonic()
                if breaker.paused_until > now:
                    self._changed.wait(breaker.paused_until - now)
                elif breaker.probing:
                    self._changed.wait()
                else:
                    if breaker.opened and breaker.failures >= self.failures:
                        breaker.probing = True  # half-open: this row is the probe
                        return True
                    return False

    def record(self, host: str, transient: bool, probe: bool) -> None:
        """A row's outcome at ``host`` (``probe``: what :meth:`enter` said): count it, and
        open or close the breaker."""
        if self.failures is None:
            return
        with self._changed:
            breaker = self._breakers[host]
            if self.leases is not None:
                self.leases.report(host, transient)
            if probe:
                breaker.probing = False
            if not transient:
                breaker.failures = 0
                self._changed.notify_all()
                return
            breaker.failures += 1
            if probe or breaker.failures == self.failures:
                self._open(host, breaker)
            self._changed.notify_all()

    def _open(self, host: str, breaker: _Breaker) -> None:
        breaker.opened += 1
        shared = self.leases is not None and self.leases.current(host) is not FALLBACK
        if shared:
            assert self.leases is not None
            self.leases.opened(host, breaker.opened)  # counted where the coordinator says
        else:
            self.counts[host]["breaker_opened"] += 1
        if breaker.opened > self.max_pauses:
            breaker.given_up = True
            return
        pause = self.pause_s * 2 ** (breaker.opened - 1)
        breaker.paused_until = time.monotonic() + pause
        if not shared:
            self.counts[host]["paused_ms"] += round(pause * 1000)

    def _granted(self, host: str, grant: dict[str, Any], now: float) -> None:
        """A coordinator's grant (under the lock): start a new Crawl-delay turn's bucket,
        take its breaker, count its opening."""
        if grant.get("turn") is not None and self._turns.get(host) != grant["turn"]:
            # one token at the turn's start, none before: the first request waits for it
            self._turns[host] = grant["turn"]
            self._tokens[host] = (1.0, grant["starts_at"])
        if self.failures is None:
            return
        if grant["counted"]:
            self.counts[host]["breaker_opened"] += 1
            if not grant["given_up"]:
                self.counts[host]["paused_ms"] += round(
                    self.pause_s * 2 ** (grant["opened"] - 1) * 1000)
        breaker = self._breakers[host]
        if grant["given_up"]:
            breaker.given_up = True
        elif grant["opened"] >= breaker.opened and grant["pause_left"] > 0:
            if grant["opened"] > breaker.opened:  # another task's rows opened it
                breaker.opened = grant["opened"]
                breaker.failures = max(breaker.failures, self.failures)  # then a probe
            breaker.paused_until = max(breaker.paused_until, now + grant["pause_left"])

    def _unsent_open(self, host: str, opened: int) -> None:
        """An opening this task made whose report no coordinator received: counted here,
        as under the per-task rule (under the lock)."""
        self.counts[host]["breaker_opened"] += 1
        if opened <= self.max_pauses:
            self.counts[host]["paused_ms"] += round(self.pause_s * 2 ** (opened - 1) * 1000)

    def _fell_back(self, host: str) -> None:
        self.counts[host]["coordinator_fallback"] += 1

    def count(self, host: str, event: str) -> None:
        with self._lock:
            self.counts[host][event] += 1

    def stats(self) -> dict[str, Any]:
        """Per host with any event: its counts (throttled requests and their wait,
        backoffs, breaker openings, pause time, rows ended host_paused, falls back to
        the per-task rule)."""
        with self._lock:
            return {host: dict(sorted(c.items())) for host, c in sorted(self.counts.items())
                    if c}


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The politeness stats of a shard's parts, added up per host."""
    merged: dict[str, Counter[str]] = defaultdict(Counter)
    for part in parts:
        for host, counts in part.items():
            merged[host].update(counts)
    return {host: dict(sorted(c.items())) for host, c in sorted(merged.items())}
