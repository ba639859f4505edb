"""The run-wide state of a share of the hosts, without Ray: what a host coordinator holds.

A stage-1 run has a few coordinators (``download/host_actors.py`` makes them Ray actors);
each host belongs to one of them by a hash of its name (:func:`shard_of`). Shard tasks
take **leases** from it: a share of the host's request rate and of its connections for
``lease_s`` seconds, which the task renews in the background (``download/host_leases.py``)
so that no request waits on a remote call. :class:`HostBook` is the arithmetic:

* **Rate.** The host's ``per_host_requests_per_s`` is divided among the tasks holding a
  live lease of it, in whole requests a second where it can (20 among 3: 7, 7 and 6; the
  remainder by a fixed order of the tasks). A new holder is given only what the live
  leases leave free, so the grants never add up to more than the rate; the holders'
  shares shrink to theirs as they renew (every half lease), and the rest goes to the
  newcomer at its next ask. The burst is divided in proportion.
* **Crawl-delay.** Where the host's robots.txt asks for a pace (``Crawl-delay``, which
  the tasks report), a divided rate is not enough: two tasks each within their share can
  still send a moment apart. The host's holders then send by **turns**: one holder at a
  time, at the slower of the cap and one request per delay, with no burst; a turn lasts
  ``TURN_LEASES`` leases (or ``TURN_SPACINGS`` delays, if longer) and the next holder's
  begins one delay after it ends (or after its holder let go of the host, or its lease
  ended). The next turn goes to the holder that had one least recently, and is set a
  lease before the current one ends, so its holder knows its start in time. A grant
  carries its turn as durations (``starts_in``, ``ends_in``); the holder counts the end
  from when it asked and the start from when it was answered, so the turns of two
  holders never overlap on their own clocks either. A sole holder's turn is extended
  without a gap.
* **Connections.** ``per_host_connections`` is divided the same way, in whole
  connections.
* With more holders than units (requests a second, connections), the units go to the
  holders served least recently, so they rotate among the holders at each renewal.
* **Breaker.** Holders report their rows' transient failures (and a success since the
  last report); the book adds them up across tasks, so ``host_failures`` in a row of one
  host open its breaker whichever tasks saw them. A task whose own count opened it
  reports the opening with its number; the book records each number once (the grant says
  to the one task it counted for), pauses the host for everyone (the pause's time left
  goes out with every grant, so each holder learns of it at its next renewal: within
  half a lease) and gives the host up after ``host_max_pauses`` openings.

Bounded: a host's row lives while a lease of it is live, or, once its breaker opened,
for ``BREAKER_KEEP_S`` after its last ask; the book holds no per-row data.
:class:`FileStore` keeps the origins' robots.txt and tdmrep.json, fetched once for the
run by the task the store asks to, in a byte-bounded LRU. That task's claim to the fetch
lives while the task renews it (every half lease, ``consent.FileCache``), so a task lost
with its node holds the others up for ``FILE_CLAIM_S`` (4 s) at most, where a claim of
fixed life had to outlast the slowest fetch (a minute).
"""

from __future__ import annotations

import math
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pairforge.config import DownloadConfig

LEASE_S = 2.0  # a lease's life; holders renew at half of it
BREAKER_KEEP_S = 600.0  # how long a host whose breaker opened is kept after its last ask
# a claim to fetch an origin's file lapses this long after its task last renewed it
# (every half lease while it fetches): its task died, and another may fetch it
FILE_CLAIM_S = 2 * LEASE_S
FILE_STORE_BYTES = 32 << 20  # the files a coordinator keeps, at most
TURN_LEASES = 4  # a Crawl-delay host's turn: this many leases ...
TURN_SPACINGS = 4  # ... or this many of its delays, if longer


def shard_of(host: str, shards: int) -> int:
    """The coordinator of ``host``: a hash every process of the run computes alike
    (Python's own ``hash`` of a string differs between processes)."""
    return zlib.crc32(host.encode("utf-8", "surrogatepass")) % shards


@dataclass
class _Holder:
    rate: float = 0.0
    connections: int = 0
    expires: float = 0.0
    # when last given some rate, some connections: the order in which they rotate
    served_rate: float = float("-inf")
    served_connections: float = float("-inf")


def _divide(total: float, n: int, rank: int) -> float:
    """The share of the holder at ``rank`` of ``n`` in whole units (requests a second,
    connections): ``total // n`` each and the rest one unit each from rank 0. Whole
    requests a second keep each task's requests in step with the 1-s windows a site
    counts in: 2.5 and 2.5 a second can both send 3 in one second, 3 and 2 cannot."""
    base = math.floor(total / n)
    return base + min(1.0, max(0.0, total - base * n - rank))


def _rank(host: _Host, task: str, rotate: bool, what: str) -> int:
    """``task``'s place among ``host``'s holders: a fixed order of the tasks, or with
    ``rotate`` (more holders than units) the holders served ``what`` least recently first."""
    def key(item: tuple[str, _Holder]) -> tuple[float, str]:
        return (getattr(item[1], f"served_{what}") if rotate else 0.0, item[0])

    ranked = sorted(host.holders.items(), key=key)
    return next(i for i, (t, _) in enumerate(ranked) if t == task)


@dataclass
class _Turn:
    """When one holder of a Crawl-delay host may send (the coordinator's clock)."""

    task: str
    starts: float
    ends: float
    number: int


@dataclass
class _Host:
    holders: dict[str, _Holder] = field(default_factory=dict)
    failures: int = 0  # transient failures in a row, all tasks together
    opened: int = 0
    paused_until: float = 0.0
    given_up: bool = False
    touched: float = 0.0
    spacing: float = 0.0  # robots.txt's Crawl-delay, the longest a task reported
    turns: list[_Turn] = field(default_factory=list)  # the current turn and the next
    last_end: float = float("-inf")  # when the last turn that is over ended
    turns_made: int = 0


@dataclass(frozen=True)
class Limits:
    """What a book divides: one host's run-wide settings (``DownloadConfig``'s)."""

    rate: float | None
    burst: float
    connections: int
    failures: int | None
    pause_s: float
    max_pauses: int

    @classmethod
    def of(cls, cfg: DownloadConfig) -> Limits:
        return cls(cfg.per_host_requests_per_s, float(cfg.per_host_burst),
                   cfg.per_host_connections, cfg.host_failures, cfg.host_pause_s,
                   cfg.host_max_pauses)


class HostBook:
    """One coordinator's hosts: leases, shares and breakers; see the module docstring.
    ``clock``: seconds, the coordinator's own (grants carry durations, never times)."""

    def __init__(self, limits: Limits, lease_s: float = LEASE_S, clock=time.monotonic) -> None:
        self.limits = limits
        self.lease_s = lease_s
        self.clock = clock
        self.hosts: dict[str, _Host] = {}

    def exchange(self, task: str, asks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Answer one task's asks (each: ``host``; ``release``: it is done with the host;
        ``failures``: transient failures since its last report, ``success``: a row that
        was not, before them; ``opened``: the number of a breaker opening its own count
        made) with a grant per host (one ``released`` for a host let go: its breaker's
        state, and whether its last report opened the breaker)."""
        now = self.clock()
        self._expire(now)
        grants = []
        for ask in asks:
            host = self.hosts.setdefault(ask["host"], _Host())
            host.touched = now
            if ask.get("release"):  # its last reports first: an opening it made counts
                counted = self._breaker(host, ask, now)
                host.holders.pop(task, None)
                if host.spacing > 0:
                    self._schedule(host, now)  # its turn ends now: the next may begin
                grants.append({**self._grant(ask["host"], host, _Holder(), counted, now),
                               "released": True})
                continue
            host.spacing = max(host.spacing, ask.get("spacing", 0.0))
            counted = self._breaker(host, ask, now)
            holder = host.holders.setdefault(task, _Holder())
            self._share(host, task, holder, now)
            turn = None
            if host.spacing > 0:
                self._schedule(host, now)
                turn = self._turn(host, task)
                holder.rate = self.rate_of(host)[0] if turn is not None else 0.0
            grants.append(self._grant(ask["host"], host, holder, counted, now, turn))
        return grants

    # shares ---------------------------------------------------------------------------

    def rate_of(self, host: _Host) -> tuple[float | None, float]:
        """The host's rate and burst for the run: the cap; under a Crawl-delay the
        slower of the cap and one request per delay, with no burst (a turn's holder
        alone sends at it)."""
        rate, burst = self.limits.rate, self.limits.burst
        if host.spacing > 0:
            return min(rate or math.inf, 1.0 / host.spacing), 1.0
        return rate, burst

    def _turn(self, host: _Host, task: str) -> _Turn | None:
        return next((turn for turn in host.turns if turn.task == task), None)

    def _schedule(self, host: _Host, now: float) -> None:
        """Bring a Crawl-delay host's turns up to ``now``: end those that are over or
        whose holder left (it sent nothing since: a release follows its last request, an
        expired lease let it send only until then), and set the next turn once the
        current one ends within a lease."""
        kept = []
        for turn in host.turns:
            if turn.task not in host.holders:
                if turn.starts >= now:
                    continue  # never began
                turn.ends = min(turn.ends, now)
            if turn.ends <= now:
                host.last_end = max(host.last_end, turn.ends)
                continue
            kept.append(turn)
        host.turns = kept
        if len(kept) > 1 or not host.holders or (kept and kept[0].ends - now > self.lease_s):
            return
        length = max(TURN_LEASES * self.lease_s, TURN_SPACINGS * host.spacing)
        current = kept[0] if kept else None
        waiting = sorted((h.served_rate, t) for t, h in host.holders.items()
                         if current is None or t != current.task)
        if current is not None and not waiting:
            current.ends = now + length  # the sole holder: no gap, its own bucket spaces
            return
        task = waiting[0][1]
        starts = max(now, (current.ends if current else host.last_end) + host.spacing)
        host.turns_made += 1
        kept.append(_Turn(task, starts, starts + length, host.turns_made))
        host.holders[task].served_rate = now

    def _share(self, host: _Host, task: str, holder: _Holder, now: float) -> None:
        limits, others = self.limits, [h for t, h in host.holders.items() if t != task]
        holder.expires = now + self.lease_s
        n = len(others) + 1
        rate, _ = self.rate_of(host)
        if rate is not None:
            share = _divide(rate, n, _rank(host, task, n > rate, "rate"))
            holder.rate = max(0.0, min(share, rate - sum(h.rate for h in others)))
            if holder.rate:
                holder.served_rate = now
        share = _divide(limits.connections, n,
                        _rank(host, task, n > limits.connections, "connections"))
        free = limits.connections - sum(h.connections for h in others)
        holder.connections = int(max(0, min(share, free)))
        if holder.connections:
            holder.served_connections = now

    def _expire(self, now: float) -> None:
        for name in list(self.hosts):
            host = self.hosts[name]
            for task in [t for t, h in host.holders.items() if h.expires <= now]:
                del host.holders[task]
            if host.spacing > 0:
                self._schedule(host, now)
            if host.holders:
                continue
            if now < host.last_end + host.spacing:
                continue  # kept until the last turn is a delay behind: the next one waits
            # a breaker that opened is kept a while: the next pause doubles, and a host
            # given up stays given up for the tasks that come later
            if not host.opened or now - host.touched > BREAKER_KEEP_S:
                del self.hosts[name]

    # the breaker ----------------------------------------------------------------------

    def _breaker(self, host: _Host, ask: dict[str, Any], now: float) -> bool:
        """Take a task's report into ``host``'s breaker; True when an opening it made was
        counted here (for that task's stats)."""
        threshold = self.limits.failures
        if threshold is None or host.given_up:
            return False
        opened = ask.get("opened")
        if opened is not None:
            if opened <= host.opened:
                return False  # another task's report opened it already: counted once
            host.opened = opened - 1  # the task's number: a restarted coordinator's is 0
            self._open(host, now)
            return True
        if ask.get("success"):
            host.failures = 0
        host.failures += ask.get("failures", 0)
        if host.failures >= threshold and host.paused_until <= now:
            self._open(host, now)
            return True
        return False

    def _open(self, host: _Host, now: float) -> None:
        host.opened += 1
        host.failures = 0
        if host.opened > self.limits.max_pauses:
            host.given_up = True
            return
        host.paused_until = now + self.pause_of(host.opened)

    def pause_of(self, opened: int) -> float:
        """The pause of a breaker's ``opened``-th opening (doubled each time)."""
        return self.limits.pause_s * 2 ** (opened - 1)

    def _grant(self, name: str, host: _Host, holder: _Holder, counted: bool,
               now: float, turn: _Turn | None = None) -> dict[str, Any]:
        rate, burst = self.rate_of(host)
        grant = {"host": name, "rate": holder.rate if rate is not None else None,
                 "burst": burst * holder.rate / rate if rate else burst,
                 "connections": holder.connections, "lease_s": self.lease_s,
                 "opened": host.opened, "pause_left": max(0.0, host.paused_until - now),
                 "given_up": host.given_up, "counted": counted}
        if turn is not None:
            grant.update(turn=turn.number, starts_in=max(0.0, turn.starts - now),
                         ends_in=turn.ends - now)
        return grant


class FileStore:
    """Origins' files for the run, by key (origin URL and path): the first task to ask is
    told to fetch (a claim, lapsing ``claim_s`` after its claimant last asked), the others
    to wait, and once put every task gets the entry. At most ``max_bytes`` of entries,
    least recently used dropped first (a dropped origin is fetched again: the nodes' own
    caches are behind this one). Entries are plain dicts (``consent.HostFile``'s fields)."""

    def __init__(self, max_bytes: int = FILE_STORE_BYTES, claim_s: float = FILE_CLAIM_S,
                 clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.claim_s = claim_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._claims: dict[str, tuple[str | None, float]] = {}  # key: (claimant, until)
        self.bytes = 0

    def get(self, key: str, ttl: float, claimant: str | None = None
            ) -> tuple[str, dict[str, Any] | None]:
        """``("hit", entry)``, ``("fetch", None)``: the caller fetches it and puts it, or
        ``("wait", None)``: another task is fetching it. ``claimant`` names the caller's
        claim: asking again under it renews the claim (the fetch goes on) where another
        caller is told to wait; None: a claim no one renews."""
        found = self._entries.get(key)
        if found is not None and time.time() - found[0]["fetched_at"] < ttl:
            self._entries.move_to_end(key)
            return "hit", found[0]
        now = self.clock()
        holder, until = self._claims.get(key, (None, 0.0))
        if until > now and (claimant is None or holder != claimant):
            return "wait", None
        self._claims[key] = (claimant, now + self.claim_s)
        return "fetch", None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self._claims.pop(key, None)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        size = len(key) + len(entry.get("text") or "") + 200
        if size > self.max_bytes:
            return
        self._entries[key] = (entry, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
        for stale in [k for k, (_, until) in self._claims.items() if until <= self.clock()]:
            del self._claims[stale]
