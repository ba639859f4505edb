"""Consent per origin for stage 1: robots.txt (RFC 9309) and TDM reservations (W3C TDMRep).

``ConsentGate`` is the ``RequestGate`` a shard task's ``Fetcher`` asks before every hop of
every image request:

* robots.txt (``download.robots_txt``), parsed by ``protego`` for the product token of
  ``download.user_agent``: a disallowed URL ends ``opted_out``, reason ``robots``, with no
  request for it. A 2xx file is parsed (its first 500 KiB, as Google reads it; the rest is
  cut, and a malformed file is read leniently); a 4xx or an endless redirect chain means
  no rules (RFC 9309 2.3.1.3); a 5xx, 429 or no answer at all means "disallow all" for
  the run (2.3.1.4), and those rows keep the status of that failure (``http_error``,
  ``timeout``, ``download_error``, ``blocked_address``), with an error naming robots.txt,
  so that they count as transient failures of the host, not as its consent. ``Crawl-delay``
  (or a slower ``Request-rate``) becomes the minimum spacing of requests to that origin:
  in a run on Ray, the host's rate for the whole run where it is slower than the cap
  (the host's coordinator divides it among the tasks, ``download/host_coordinator.py``);
  else kept across the node's shard tasks of the run (a spacing file per origin).
* ``/.well-known/tdmrep.json`` (``download.tdm``): a path under a rule with
  ``tdm-reservation: 1`` ends ``opted_out``, reason ``tdm``, with no request; a missing or
  unreadable file means no reservation. (The ``tdm-reservation`` response header is the
  fetcher's.)

Each file is fetched once per origin (scheme, host, port) for a run, through a
``Fetcher`` of its own (the address guard, redirects up to ``download.max_redirects``,
each hop vetted, another host allowed), and cached for 24 hours at most (RFC 9309 2.4),
in three tiers: in memory for the task's threads; in the run's host coordinator of that
host (``download/host_coordinator.py``'s ``FileStore``: the first task to ask fetches,
the run's other tasks on every node wait for its answer; its claim lives while it renews
it, so a task lost with its node holds the others up for seconds, and the next to ask
fetches the file); and as a file in the node's
temporary folder, written atomically under a per-origin lock, behind the coordinator
(a task run on its own, an origin the coordinator's bounded store dropped, or a
coordinator that does not answer: then it is fetched once per node, as before issue 52).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protego import Protego

from pairforge.config import DownloadConfig
from pairforge.download.fetch import Fetcher, FetchResult, Origin
from pairforge.download.host_actors import end_run
from pairforge.download.host_coordinator import FILE_CLAIM_S, shard_of
from pairforge.download.host_leases import CoordinatorLink
from pairforge.download.tdmrep import WELL_KNOWN_PATH, TdmRule, parse_tdmrep, reservation_for
from pairforge.records import Status

log = logging.getLogger(__name__)

ROBOTS_PATH = "/robots.txt"
FILE_MAX_BYTES = 500 * 1024  # Google parses the first 500 KiB of a robots.txt
CACHE_TTL = 24 * 3600.0  # RFC 9309 2.4: a cached robots.txt is used for 24 hours at most
_CACHE_ROOT = "pairforge-consent"
# the longest a task waits for another task's fetch of a file, however long that one keeps
# its claim (a live claimant renews it every RENEW_S; a dead one's lapses in FILE_CLAIM_S)
FILE_WAIT_S = 60.0
RENEW_S = FILE_CLAIM_S / 4
# A file fetch that failed this way: the origin could not be asked (RFC 9309 2.3.1.4).
_UNREACHABLE = {Status.HTTP_ERROR, Status.TIMEOUT, Status.DOWNLOAD_ERROR,
                Status.BLOCKED_ADDRESS, Status.INVALID_URL}


def cache_dir(run_id: str) -> Path:
    """The node-local folder a run's tasks share their fetched files in."""
    return Path(tempfile.gettempdir()) / _CACHE_ROOT / run_id


def remove_cache(run_id: str) -> None:
    """Remove a finished run's folder on this node (other nodes' temp folders keep theirs)
    and its host coordinators, which hold the files the nodes shared."""
    shutil.rmtree(cache_dir(run_id), ignore_errors=True)
    end_run(run_id)


def origin_url(origin: Origin) -> str:
    scheme, host, port = origin
    host = f"[{host}]" if ":" in host else host
    default = (scheme == "http" and port == 80) or (scheme == "https" and port == 443)
    return f"{scheme}://{host}" if default else f"{scheme}://{host}:{port}"


@dataclass
class HostFile:
    """What fetching one file of an origin gave: ``ok`` (its text), ``missing`` (4xx, or
    too many redirects) or ``unreachable`` (``status``, ``http_status``, ``error``)."""

    outcome: str
    fetched_at: float
    text: str = ""
    status: str | None = None
    http_status: int | None = None
    error: str | None = None

    @classmethod
    def of(cls, result: FetchResult) -> HostFile:
        now = time.time()
        if result.status == Status.OK:
            text = (result.body or b"").decode("utf-8", errors="replace")
            return cls("ok", now, text.removeprefix("\ufeff"), http_status=result.http_status)
        code = result.http_status
        if result.status in _UNREACHABLE and not (code and 400 <= code < 500 and code != 429):
            return cls("unreachable", now, status=result.status.value, http_status=code,
                       error=result.error)
        return cls("missing", now, http_status=code, error=result.error)


class FileCache:
    """An origin's files, fetched once per ``ttl`` for the run: asked of the host's
    coordinator first (``link``, when the task has one), then of this node: a JSON file
    per origin and path, written atomically; a lock file per entry makes the node's other
    tasks wait for the one fetching it instead of fetching it again."""

    def __init__(self, folder: Path, fetch: Callable[[str], FetchResult], ttl: float,
                 link: CoordinatorLink | None = None) -> None:
        self.folder = folder
        self.fetch = fetch
        self.ttl = ttl
        self.link = link
        self.claimant = uuid.uuid4().hex[:12]  # names this task's claims to a fetch
        self.fetched: Counter[str] = Counter()  # fetches this process made, by path
        folder.mkdir(parents=True, exist_ok=True)

    def get(self, origin: Origin, path: str) -> HostFile:
        if self.link is None:
            return self._on_node(origin, path)
        key, shard = origin_url(origin) + path, shard_of(origin[1], self.link.shards)
        waited_until, pause = time.monotonic() + FILE_WAIT_S, 0.05
        try:
            while True:
                state, entry = self.link.get_file(shard, key, self.ttl, self.claimant)
                if state == "hit" and entry is not None:
                    return HostFile(**entry)
                if state == "fetch" or time.monotonic() > waited_until:
                    with self._renewing(shard, key):
                        found = self._on_node(origin, path)
                    self.link.put_file(shard, key, found.__dict__)
                    return found
                # another task fetches it; asked again less and less often, so that many
                # tasks waiting on a slow origin do not flood its coordinator
                time.sleep(pause)
                pause = min(1.0, pause * 2)
        except Exception as err:  # noqa: BLE001 - a coordinator lost: this node's cache
            log.warning("host coordinator of %s did not answer for %s (%s): read through "
                        "this node's cache", origin_url(origin), path, err)
            return self._on_node(origin, path)

    @contextmanager
    def _renewing(self, shard: int, key: str) -> Iterator[None]:
        """Renew this task's claim to fetch ``key`` while the block runs (a fetch may take
        its timeouts and redirects, far longer than a claim lives): asked again under the
        task's claimant, the coordinator extends the claim; a renewal that fails leaves
        the claim to lapse, and at worst another task fetches the file too."""
        assert self.link is not None
        link, done = self.link, threading.Event()

        def renew() -> None:
            while not done.wait(RENEW_S):
                try:
                    link.get_file(shard, key, self.ttl, self.claimant)
                except Exception:  # noqa: BLE001, S112 - a lost coordinator: lapses
                    continue

        renewer = threading.Thread(target=renew, name="file-claim", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            done.set()
            renewer.join()  # a renewal that came after the put would claim the key again

    def _on_node(self, origin: Origin, path: str) -> HostFile:
        name = _entry_name(origin, path)
        with _file_lock(self.folder / f"{name}.lock"):
            entry = self._read(self.folder / f"{name}.json")
            if entry is not None and time.time() - entry.fetched_at < self.ttl:
                return entry
            entry = HostFile.of(self.fetch(origin_url(origin) + path))
            self.fetched[path] += 1
            tmp = self.folder / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps(entry.__dict__))
            os.replace(tmp, self.folder / f"{name}.json")
            return entry

    @staticmethod
    def _read(path: Path) -> HostFile | None:
        try:
            return HostFile(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def _entry_name(origin: Origin, path: str) -> str:
    return hashlib.sha256(f"{origin_url(origin)}{path}".encode()).hexdigest()[:32]


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # flock locks belong to the open file: other threads' and processes' opens wait
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class _OriginRules:
    """One origin's rules as this process parsed them."""

    checked_at: float
    robots: HostFile | None = None
    parser: Protego | None = None
    delay: float = 0.0  # seconds between requests (Crawl-delay, Request-rate)
    tdm: list[TdmRule] = field(default_factory=list)


class ConsentGate:
    """robots.txt and tdmrep.json per origin; see the module docstring."""

    def __init__(self, cfg: DownloadConfig, folder: Path, ttl: float = CACHE_TTL,
                 link: CoordinatorLink | None = None) -> None:
        self.cfg = cfg
        self.token = cfg.agent_token
        file_cfg = cfg.model_copy(update={"max_bytes": FILE_MAX_BYTES, "respect_robots": False,
                                          "tdm": False})
        self.fetcher = Fetcher(file_cfg, truncate=True,
                               accept="text/plain, application/json;q=0.9, */*;q=0.5")
        self.files = FileCache(folder, self.fetcher.fetch, ttl, link)
        self.ttl = ttl
        self._origins: dict[Origin, _OriginRules] = {}
        self._locks: dict[Origin, threading.Lock] = {}
        self._lock = threading.Lock()
        self.unreachable_rows: Counter[str] = Counter()  # per origin URL

    def close(self) -> None:
        self.fetcher.close()

    # RequestGate ----------------------------------------------------------------------

    def admit(self, url: str, origin: Origin) -> FetchResult | None:
        rules = self._rules(origin)
        robots = rules.robots
        if robots is not None and robots.outcome == "unreachable":
            with self._lock:
                self.unreachable_rows[origin_url(origin)] += 1
            return FetchResult(
                Status(robots.status), f"robots.txt of {origin_url(origin)} unreachable "
                f"({robots.error}): no request made, the host disallows all for this run "
                "(RFC 9309 2.3.1.4)", http_status=robots.http_status)
        if rules.parser is not None and not rules.parser.can_fetch(url, self.token):
            return FetchResult(Status.OPTED_OUT, f"robots.txt of {origin_url(origin)} "
                               f"disallows this URL for {self.token}", opt_out_reason="robots")
        rule = reservation_for(rules.tdm, _path_of(url)) if rules.tdm else None
        if rule is not None and rule.reserved:
            policy = f", policy {rule.policy}" if rule.policy else ""
            return FetchResult(Status.OPTED_OUT, f"{WELL_KNOWN_PATH} of {origin_url(origin)} "
                               f"reserves TDM rights under {rule.location}{policy}",
                               opt_out_reason="tdm")
        return None

    def spacing(self, origin: Origin) -> float:
        return self._rules(origin).delay

    def pace(self, origin: Origin) -> None:
        rules = self._rules(origin)
        if rules.delay <= 0:
            return
        with _file_lock(self.files.folder / f"{_entry_name(origin, '')}.pace.lock"):
            spacing = self.files.folder / f"{_entry_name(origin, '')}.pace"
            try:
                next_at = float(spacing.read_text() or 0)
            except (OSError, ValueError):
                next_at = 0.0
            now = time.time()
            at = max(now, next_at)
            spacing.write_text(repr(at + rules.delay))
        if at > now:
            time.sleep(at - now)

    # rules ----------------------------------------------------------------------------

    def _rules(self, origin: Origin) -> _OriginRules:
        rules = self._origins.get(origin)
        if rules is not None and time.time() - rules.checked_at < self.ttl:
            return rules
        with self._lock:
            lock = self._locks.setdefault(origin, threading.Lock())
        with lock:  # one thread of the task reads the origin's files; the others wait
            rules = self._origins.get(origin)
            if rules is None or time.time() - rules.checked_at >= self.ttl:
                rules = self._load(origin)
                self._origins[origin] = rules
            return rules

    def _load(self, origin: Origin) -> _OriginRules:
        rules = _OriginRules(time.time())
        if self.cfg.robots_txt:
            rules.robots = self.files.get(origin, ROBOTS_PATH)
            if rules.robots.outcome == "ok":
                rules.parser = Protego.parse(rules.robots.text)
                rules.delay = _spacing(rules.parser, self.token)
        if self.cfg.tdm:
            tdm = self.files.get(origin, WELL_KNOWN_PATH)
            rules.tdm = parse_tdmrep(tdm.text) if tdm.outcome == "ok" else []
        return rules

    # stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the shard's stats keep: files fetched by this task (not found in the node's
        cache), and per origin with something to say its robots outcome and spacing."""
        origins: dict[str, dict[str, Any]] = {}
        for origin, rules in list(self._origins.items()):
            robots = rules.robots
            if robots is None or (robots.outcome != "unreachable" and rules.delay <= 0):
                continue
            entry: dict[str, Any] = {"robots_txt": robots.outcome}
            if rules.delay > 0:
                entry["crawl_delay"] = rules.delay
            if robots.outcome == "unreachable":
                entry["robots_unreachable"] = self.unreachable_rows[origin_url(origin)]
            origins[origin_url(origin)] = entry
        return {"fetched": dict(self.files.fetched), "origins": origins}


def _spacing(parser: Protego, token: str) -> float:
    """Seconds between two requests: Crawl-delay, or a slower Request-rate."""
    delay = float(parser.crawl_delay(token) or 0)
    rate = parser.request_rate(token)
    if rate is not None and rate.requests:
        delay = max(delay, rate.seconds / rate.requests)
    return max(delay, 0.0)


def _path_of(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def make_gate(cfg: DownloadConfig, run_id: str | None,
              link: CoordinatorLink | None = None) -> ConsentGate | None:
    """The gate of a shard task, or None when robots.txt and TDM are both off. Without a
    ``run_id`` (a task run on its own) the files are this process's own; ``link``: the
    run's host coordinators, which share the files across nodes."""
    if not (cfg.robots_txt or cfg.tdm):
        return None
    return ConsentGate(cfg, cache_dir(run_id or f"pid{os.getpid()}-{time.time_ns()}"),
                       link=link)


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The consent stats of a shard's parts, added up (a spacing is the largest seen)."""
    merged: dict[str, Any] = {}
    for part in parts:
        _add(merged, part)
    return merged


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict):
            _add(into.setdefault(key, {}), value)
        elif key == "crawl_delay":
            into[key] = max(into.get(key, 0), value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value
        else:
            into.setdefault(key, value)
