"""Per-host politeness of one fetcher (one shard task): a request-rate cap, jittered
backoff and a circuit breaker, with their counts per host.

* **Rate cap** (``download.per_host_requests_per_s``, ``download.per_host_burst``): a token
  bucket per host; every request takes a token, retries and redirect hops included, and
  waits for one when the bucket is empty. It sits beside the connection cap
  (``per_host_connections``) and robots.txt's Crawl-delay (``download/consent.py``, shared
  by a node's tasks): a request waits for all three. The bucket is the task's own, so
  ``processes`` tasks fetching one host at once may together reach ``processes`` times the
  rate; set the rate per task accordingly (the shards of a run are planned in input
  order, so a host's rows mostly fall in one or few shards).
* **Backoff** on 429/5xx and refused or cut connections without Retry-After: "full
  jitter", a uniform delay in [0, ``backoff`` x 2^attempt] (``pairforge/backoff.py``, the
  one backoff rule), so the threads and tasks that failed together do not come back
  together (Retry-After, when sent, is obeyed as is). The fetcher counts each per host here.
* **Circuit breaker** (``download.host_failures``, ``download.host_pause_s``,
  ``download.host_max_pauses``): after ``host_failures`` rows in a row of one host end in a
  transient failure (timeout, connection, 429, 5xx), the host is paused for
  ``host_pause_s``. Rows of a paused host wait for the pause to end; then one of them
  probes the host (the others wait for its answer): a success closes the breaker, a
  transient failure opens it again for twice as long. After ``host_max_pauses`` openings
  the host is given up for the rest of the task: its remaining rows end ``host_paused``
  without a request, as do the rows that were waiting. Everything else (404, an opt-out,
  a body that is not an image) shows the host is up and resets its count.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from typing import Any

from pairforge.config import DownloadConfig
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


class HostPolicy:
    """The rate cap and circuit breaker of one fetcher's hosts; thread-safe."""

    def __init__(self, cfg: DownloadConfig) -> None:
        self.rate = cfg.per_host_requests_per_s
        self.burst = float(cfg.per_host_burst)
        self.failures = cfg.host_failures
        self.pause_s = cfg.host_pause_s
        self.max_pauses = cfg.host_max_pauses
        self._tokens: dict[str, tuple[float, float]] = {}  # host: (tokens, at)
        self._breakers: dict[str, _Breaker] = defaultdict(_Breaker)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)

    # the rate cap ---------------------------------------------------------------------

    def take_token(self, host: str) -> None:
        """Wait until ``host``'s bucket holds a token, and take it."""
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            tokens, at = self._tokens.get(host, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate) - 1.0
            self._tokens[host] = (tokens, now)
            # a negative balance is this request's place in the queue: it waits its turn
            wait = -tokens / self.rate if tokens < 0 else 0.0
            if wait:
                self.counts[host]["throttled"] += 1
                self.counts[host]["throttled_ms"] += round(wait * 1000)
        if wait:
            time.sleep(wait)

    # the breaker ----------------------------------------------------------------------

    def enter(self, host: str) -> bool:
        """Wait while ``host`` is paused or probed by another row; raise HostGivenUp when
        it was given up. On return the row may request; True: as the probe of a breaker
        whose pause just ended (pass it to :meth:`record`)."""
        if self.failures is None:
            return False
        with self._changed:
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
        self.counts[host]["breaker_opened"] += 1
        if breaker.opened > self.max_pauses:
            breaker.given_up = True
            return
        pause = self.pause_s * 2 ** (breaker.opened - 1)
        breaker.paused_until = time.monotonic() + pause
        self.counts[host]["paused_ms"] += round(pause * 1000)

    def count(self, host: str, event: str) -> None:
        with self._lock:
            self.counts[host][event] += 1

    def stats(self) -> dict[str, Any]:
        """Per host with any event: its counts (throttled requests and their wait,
        backoffs, breaker openings, pause time, rows ended host_paused)."""
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
