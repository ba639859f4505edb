"""A shard task's leases of its hosts from the run's host coordinators.

``HostLeases`` runs one background thread per task. A host's first request registers it
and waits for the first grant (one batched call); from then on the thread renews each
lease at half its life, sends the breaker reports as they come, and releases a host the
task has not used for a lease's life, so requests only read the grant in memory. One call
per coordinator per round carries all of that coordinator's hosts.

**Coordinator loss.** A call that fails or takes too long (``host_actors.py``: 1 s for a
lease call) marks its coordinator down: its hosts keep their leases until these expire,
then follow the per-task rule (the task's own ``per_host_*`` settings, as before issue
52), which the log says once per outage and the shard's politeness stats count
(``coordinator_fallback``). The thread calls again a second later (the coordinator is
restarted by Ray, or made again); once it answers, the hosts take leases again. Nothing
a row waits for can hang on a coordinator: the longest wait is one call's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pairforge.download.host_coordinator import LEASE_S, HostBook, Limits, shard_of

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
TICK_S = 0.05  # how often the thread looks for leases to renew and reports to send
STARVED_RETRY_S = 0.2  # a host granted nothing (rate or connections) asks again this soon
DOWN_RETRY_S = 1.0
RIDE_ALONG = 0.25  # of a lease: how early a renewal joins a call made anyway
FALLBACK = object()  # ``current``: the per-task rule applies to this host now

Grant = dict[str, Any]


class CoordinatorLink(Protocol):
    """The run's coordinators as a task reaches them (``download/host_actors.py``)."""

    shards: int

    def exchange_all(self, task: str, asks: dict[int, list[dict[str, Any]]]
                     ) -> dict[int, list[Grant] | BaseException]:
        """Each coordinator's grants for its asks, or why it did not answer."""

    def get_file(self, shard: int, key: str, ttl: float, claimant: str | None = None
                 ) -> tuple[str, dict[str, Any] | None]:
        """``FileStore.get`` on coordinator ``shard``."""

    def put_file(self, shard: int, key: str, entry: dict[str, Any]) -> None:
        """``FileStore.put`` on coordinator ``shard``."""


class LocalLink:
    """Coordinators in this process (tests, and a task's view of a book in unit tests)."""

    def __init__(self, limits: Limits, shards: int = 2, lease_s: float = LEASE_S) -> None:
        from pairforge.download.host_coordinator import FileStore

        self.shards = shards
        self.books = [HostBook(limits, lease_s) for _ in range(shards)]
        self.files = [FileStore() for _ in range(shards)]
        self.down: set[int] = set()  # coordinators that fail every call (tests)
        self._lock = threading.Lock()

    def exchange_all(self, task: str, asks: dict[int, list[dict[str, Any]]]
                     ) -> dict[int, list[Grant] | BaseException]:
        with self._lock:
            return {shard: ConnectionError(f"coordinator {shard} down") if shard in self.down
                    else self.books[shard].exchange(task, batch)
                    for shard, batch in asks.items()}

    def get_file(self, shard: int, key: str, ttl: float, claimant: str | None = None
                 ) -> tuple[str, dict[str, Any] | None]:
        with self._lock:
            if shard in self.down:
                raise ConnectionError(f"coordinator {shard} down")
            return self.files[shard].get(key, ttl, claimant)

    def put_file(self, shard: int, key: str, entry: dict[str, Any]) -> None:
        with self._lock:
            if shard in self.down:
                raise ConnectionError(f"coordinator {shard} down")
            self.files[shard].put(key, entry)


@dataclass
class _Entry:
    grant: Grant | None = None
    expires: float = 0.0
    renew_at: float = 0.0
    asked_at: float = float("-inf")
    last_used: float = 0.0
    fallback: bool = False
    failures: int = 0  # breaker reports not yet sent
    success: bool = False
    opened: int | None = None
    spacing: float = 0.0  # robots.txt's Crawl-delay, sent with every ask

    def ask(self, host: str, release: bool) -> dict[str, Any]:
        ask: dict[str, Any] = {"host": host}
        if release:
            ask["release"] = True
        if self.spacing > 0:
            ask["spacing"] = self.spacing
        if self.failures or self.success:
            ask.update(failures=self.failures, success=self.success)
        if self.opened is not None:
            ask["opened"] = self.opened
        return ask

    def restore(self, ask: dict[str, Any]) -> None:
        """Keep a report whose call failed, to be sent with the next one."""
        if self.opened is None and ask.get("opened") is not None:
            self.opened = ask["opened"]
        self.failures += ask.get("failures", 0)
        self.success = self.success or bool(ask.get("success"))


class HostLeases:
    """One task's leases; every method but the thread's runs under ``changed``, the lock
    of the task's ``HostPolicy``, which it notifies when grants change."""

    def __init__(self, link: CoordinatorLink, changed: threading.Condition,
                 on_grant: Callable[[str, Grant, float], None],
                 on_fallback: Callable[[str], None],
                 on_unsent: Callable[[str, int], None], lease_s: float = LEASE_S) -> None:
        self.link = link
        self.task = f"{uuid.uuid4().hex[:12]}"
        self.changed = changed
        self.on_grant = on_grant
        self.on_fallback = on_fallback
        self.on_unsent = on_unsent  # an opening whose report never reached a coordinator
        self.lease_s = lease_s
        self._entries: dict[str, _Entry] = {}
        # coordinators whose last call failed: when to call again (their hosts whose
        # leases ended follow the per-task rule until one answers)
        self._down_until: dict[int, float] = {}
        self._wake = threading.Event()
        self._closed = False
        self._broken = False  # the thread stopped on a bug: every host per task
        self._thread = threading.Thread(target=self._run, name="host-leases", daemon=True)
        self._thread.start()

    # read by the request threads (under ``changed``) ------------------------------------

    def current(self, host: str) -> Grant | object | None:
        """The host's live grant; ``FALLBACK``; or None: the first grant is on its way
        (wait on ``changed``)."""
        now = time.monotonic()
        if self._broken:
            return FALLBACK
        entry = self._entries.get(host)
        if entry is None:
            entry = self._entries[host] = _Entry()
            self._wake.set()
        entry.last_used = now
        if entry.grant is not None and now < entry.expires:
            return entry.grant
        if not entry.fallback and shard_of(host, self.link.shards) in self._down_until:
            entry.fallback = True  # its coordinator is down: no wait for its answer
            self.on_fallback(host)
        return FALLBACK if entry.fallback else None

    def report(self, host: str, transient: bool) -> None:
        entry = self._entries.setdefault(host, _Entry(last_used=time.monotonic()))
        if transient:
            entry.failures += 1
        else:  # failures before a success no longer count
            entry.failures, entry.success = 0, True
        self._wake.set()

    def spacing(self, host: str, seconds: float) -> None:
        """The host's Crawl-delay, for its coordinator to take into the host's rate."""
        entry = self._entries.setdefault(host, _Entry(last_used=time.monotonic()))
        if seconds > entry.spacing:
            entry.spacing = seconds
            entry.grant = None  # ask again at once: the rate it was granted is too fast
            self._wake.set()

    def opened(self, host: str, number: int) -> None:
        entry = self._entries.setdefault(host, _Entry(last_used=time.monotonic()))
        entry.opened = max(entry.opened or 0, number)
        entry.failures, entry.success = 0, False
        self._wake.set()

    def close(self) -> None:
        """Stop renewing, and release every lease so other tasks get its share now; the
        last breaker reports go with the releases (an opening this task made is counted
        in its stats: by the coordinator's word, or here when it cannot be reached)."""
        with self.changed:
            self._closed = True
        self._wake.set()
        self._thread.join(CALL_TIMEOUT_S + 1)  # a call in flight is answered and applied
        with self.changed:
            releases = self._batches({h: e.ask(h, True) for h, e in self._entries.items()})
            self._entries.clear()
        if not releases or self._broken:
            return  # nothing held, or a thread that failed: the leases lapse on their own
        try:
            results = self.link.exchange_all(self.task, releases)
        except Exception as err:  # noqa: BLE001 - the leases lapse on their own anyway
            results = {shard: err for shard in releases}
        with self.changed:
            now = time.monotonic()
            for shard, batch in releases.items():
                result = results.get(shard)
                if isinstance(result, list):
                    for grant in result:
                        self.on_grant(grant["host"], grant, now)
                    continue
                for ask in batch:
                    if ask.get("opened") is not None:
                        self.on_unsent(ask["host"], ask["opened"])

    # the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must not leave rows waiting for a grant forever
            log.exception("host leases of task %s stopped: the per-task rule from now on",
                          self.task)
            with self.changed:
                self._broken = True
                self.changed.notify_all()

    def _loop(self) -> None:
        while True:
            self._wake.wait(TICK_S)
            self._wake.clear()
            with self.changed:
                if self._closed:
                    return
                sent_at = time.monotonic()
                asks = self._due(sent_at)
                batches = self._batches(asks)
            if not batches:
                continue
            try:
                results = self.link.exchange_all(self.task, batches)
            except Exception as err:  # noqa: BLE001 - a link that fails is a lost coordinator
                results = {shard: err for shard in batches}
            with self.changed:
                self._apply(batches, results, sent_at)
                self.changed.notify_all()

    def _due(self, now: float) -> dict[str, dict[str, Any]]:
        """The asks to send now, by host; a released host's entry goes. A coordinator
        that gets a call anyway also renews the task's other hosts whose renewal falls
        within the next ``RIDE_ALONG`` of a lease: the hosts' renewals then fall together
        into one call per coordinator per half lease, where apart (each host first used
        at its own moment) they made a call on nearly every tick."""
        asks = self._due_alone(now)
        calling = {shard_of(host, self.link.shards) for host in asks}
        soon = now + self.lease_s * RIDE_ALONG
        for host, entry in self._entries.items():
            if (host not in asks and entry.grant is not None and entry.renew_at <= soon
                    and shard_of(host, self.link.shards) in calling):
                asks[host] = entry.ask(host, False)
                entry.failures, entry.success, entry.opened = 0, False, None
                entry.asked_at = now
        return asks

    def _due_alone(self, now: float) -> dict[str, dict[str, Any]]:
        asks: dict[str, dict[str, Any]] = {}
        for host, entry in list(self._entries.items()):
            if self._down_until.get(shard_of(host, self.link.shards), 0.0) > now:
                continue
            reported = entry.failures or entry.success or entry.opened is not None
            if now - entry.last_used > self.lease_s and not reported:
                if entry.grant is not None:
                    asks[host] = entry.ask(host, True)
                del self._entries[host]
                continue
            grant = entry.grant
            starved = grant is not None and (grant["connections"] == 0 or grant["rate"] == 0)
            if (grant is None or reported or now >= entry.renew_at
                    or (starved and now - entry.asked_at >= STARVED_RETRY_S)):
                asks[host] = entry.ask(host, False)
                entry.failures, entry.success, entry.opened = 0, False, None
                entry.asked_at = now
        return asks

    def _batches(self, asks: dict[str, dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
        batches: dict[int, list[dict[str, Any]]] = {}
        for host, ask in asks.items():
            batches.setdefault(shard_of(host, self.link.shards), []).append(ask)
        return batches

    def _apply(self, batches: dict[int, list[dict[str, Any]]],
               results: dict[int, Any], sent_at: float) -> None:
        now = time.monotonic()
        for shard, batch in batches.items():
            result = results.get(shard)
            if isinstance(result, BaseException) or result is None:
                self._lost(shard, batch, result, now)
                continue
            if self._down_until.pop(shard, None) is not None:
                log.warning("host coordinator %d answers again: its hosts take leases "
                            "again", shard)
            asked = {ask["host"]: ask for ask in batch}
            for grant in result:
                entry = self._entries.get(grant["host"])
                if entry is None or grant.get("released"):
                    continue  # released (an idle host's release carries no report)
                if entry.spacing > asked.get(grant["host"], {}).get("spacing", 0.0):
                    continue  # granted before the coordinator knew the Crawl-delay
                entry.expires = sent_at + grant["lease_s"]
                entry.renew_at = sent_at + grant["lease_s"] / 2
                if grant.get("turn") is not None:  # a Crawl-delay host's turn: see
                    ends = sent_at + grant["ends_in"]  # host_coordinator; its end counted
                    entry.expires = min(entry.expires, ends)  # from the ask, its start
                    entry.renew_at = min(entry.renew_at, ends)  # from the answer
                    grant = {**grant, "starts_at": now + grant["starts_in"]}
                entry.grant, entry.fallback = grant, False
                self.on_grant(grant["host"], grant, now)

    def _lost(self, shard: int, batch: list[dict[str, Any]], error: Any, now: float) -> None:
        if shard not in self._down_until:
            log.warning("host coordinator %d did not answer (%s): its hosts follow the "
                        "per-task rule (download.per_host_*) once their leases end, until "
                        "it answers again", shard, error or "no answer")
        self._down_until[shard] = now + DOWN_RETRY_S
        for ask in batch:
            entry = self._entries.get(ask["host"])
            if entry is None or ask.get("release"):
                continue
            entry.restore(ask)
            if (entry.grant is None or entry.expires <= now) and not entry.fallback:
                entry.fallback = True
                self.on_fallback(ask["host"])
