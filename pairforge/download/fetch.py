"""HTTP(S) fetching for the download stage: guarded, polite, capped, keep-alive.

One ``Fetcher`` is shared by the fetch threads of a shard task. It differs from a plain
``urllib`` fetch in the ways the download stage needs:

* every connection (and every redirect hop) goes through ``AddressGuard`` and connects
  to the vetted IP itself, so DNS rebinding cannot slip a private address past the guard;
* idle connections are pooled per (scheme, host, port) and reused across calls and
  threads (HTTP/1.1 keep-alive), which saves a TCP (and TLS) handshake per image;
* at most ``per_host_connections`` requests are in flight per host, at most
  ``per_host_requests_per_s`` start per second (in a stage-1 run on Ray, for the whole
  run: the fetcher's ``HostPolicy`` holds leases of its hosts), retries back off with
  jitter, and a host that keeps failing is paused, then given up
  (``download/politeness.py``);
* ``timeout`` is a deadline for a whole request (connect, headers and body of one try of
  one hop), enforced on every socket read, so a server that trickles bytes cannot hold a
  thread for longer; DNS lookups are the system resolver's and not covered;
* bodies are capped while streaming, and ``X-Robots-Tag`` opt-outs and
  ``tdm-reservation: 1`` are honoured before the body is read;
* a ``gate`` (``download/consent.py``: robots.txt, tdmrep.json, Crawl-delay) is asked
  before each hop whether the URL may be requested, and paces each request to its host;
* no exception escapes ``fetch``: every failure is a ``Status`` and a short message.

The client is http.client with the pool below, not urllib3: on urllib3 the same contract
still needs the guarded connect (through urllib3's private ``_new_conn``), this module's
deadline response and its own retry and redirect loops, and it cost 20-40 % more CPU per
request (bench/fetch_urllib3.py, measured in bench/RESULTS.md; docs/ARCHITECTURE.md).

Over 600 lines because ``Fetcher`` holds one request's whole path (guarded connect, pool,
deadline reads, redirects, retries, opt-out headers, body cap) and its per-request state;
the connection classes, the pool and the deadline reader beside it exist only for it.
Split apart, each hop would hand that state across modules.
"""

from __future__ import annotations

import functools
import http.client
import io
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from pairforge.backoff import full_jitter, parse_retry_after
from pairforge.config import DEFAULT_USER_AGENT, DownloadConfig
from pairforge.download.address_guard import AddressGuard, BlockedAddress
from pairforge.download.politeness import HostGivenUp, HostPolicy, is_transient
from pairforge.records import Status

USER_AGENT = DEFAULT_USER_AGENT
AGENT_NAME = "pairforge"
IMAGE_ACCEPT = "image/avif,image/webp,image/*,*/*;q=0.8"
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_DRAIN_LIMIT = 64 * 1024  # error bodies up to this size are read so the connection survives
_IDLE_MAX_AGE = 30.0  # seconds; servers close idle keep-alive connections sooner anyway
_MAX_ERROR_CHARS = 200
# Characters left as they are when a URL's path/query is made ASCII for the request line.
_URL_SAFE = "!#$%&'()*+,/:;=?@[]~"


@dataclass
class FetchResult:
    """The outcome of one ``Fetcher.fetch``; ``body`` is set only when status is OK.

    ``final_url`` is the last URL requested, or the redirect target that was refused;
    ``http_status`` the last HTTP status received (None when no response came);
    ``opt_out_reason`` why an OPTED_OUT result opted out (``x_robots_tag``, ``tdm``,
    ``robots``).
    """

    status: Status
    error: str | None = None
    body: bytes | None = None
    http_status: int | None = None
    final_url: str | None = None
    opt_out_reason: str | None = None


Origin = tuple[str, str, int]  # (scheme, host, port): what robots.txt and tdmrep.json cover


class RequestGate(Protocol):
    """Consent and pacing per origin, asked by the fetcher (``download/consent.py``)."""

    def admit(self, url: str, origin: Origin) -> FetchResult | None:
        """None when ``url`` may be requested; else the row's outcome, no request made."""

    def pace(self, origin: Origin) -> None:
        """Wait until a request to ``origin`` keeps its spacing (Crawl-delay)."""

    def spacing(self, origin: Origin) -> float:
        """Seconds between requests to ``origin`` (Crawl-delay; 0: none)."""


def robots_opt_out(values: Iterable[str], directives: Iterable[str],
                   agents: Iterable[str]) -> str | None:
    """The X-Robots-Tag value that opts out, or None (img2dataset's ``is_disallowed``).

    A header value is ``[agent:] directive[, directive...]``. It applies when it names no
    agent or names one of ``agents``; it opts out when one of its directives is in
    ``directives``. Case is ignored.
    """
    wanted = {d.strip().lower() for d in directives}
    ours = {a.strip().lower() for a in agents if a}
    for value in values:
        agent, sep, rest = value.partition(":")
        if sep and agent.strip().lower() not in ours:
            continue  # addressed to another crawler
        listed = rest if sep else value
        if any(d.strip().lower() in wanted for d in listed.split(",")):
            return value.strip()
    return None


# --------------------------------------------------------------------------- connections


class _Deadline:
    """The end of the current request, shared by a connection and its responses."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = float("inf")

    def remaining(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left


class _DeadlineReader(io.RawIOBase):
    """Socket reads that each wait only until the request deadline.

    A socket timeout alone bounds one ``recv``; a server sending a byte every few
    seconds would never trip it. Re-arming the timeout before every read bounds the total.
    The reads go through ``sock.makefile()``'s raw reader, whose reference keeps the
    socket open after http.client hands a ``Connection: close`` response its socket.
    """

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self._sock.settimeout(self._deadline.remaining())
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock, debuglevel=0, method=None, url=None, *, deadline: _Deadline):
        super().__init__(sock, debuglevel, method, url)
        plain = self.fp
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline))
        plain.close()  # after the new reader took its reference, so the socket stays open


def _open_vetted(guard: AddressGuard, host: str, port: int,
                 deadline: _Deadline) -> socket.socket:
    """A TCP socket to the first allowed address of ``host`` that accepts."""
    last_error: OSError | None = None
    for family, sockaddr in guard.resolve(host, port):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.remaining())
            sock.connect(sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as err:
            sock.close()
            last_error = err
            if isinstance(err, TimeoutError):
                break  # the deadline is spent; another address would not help
    assert last_error is not None  # resolve() returns at least one address or raises
    raise last_error


class _GuardedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, guard: AddressGuard) -> None:
        super().__init__(host, port)
        self.guard = guard
        self.deadline = _Deadline()
        self.response_class = functools.partial(_DeadlineResponse, deadline=self.deadline)

    def connect(self) -> None:
        # Connect to the address the guard vetted, never to a second lookup's answer.
        self.sock = _open_vetted(self.guard, self.host, self.port, self.deadline)


class _GuardedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, guard: AddressGuard,
                 context: ssl.SSLContext) -> None:
        super().__init__(host, port, context=context)
        self.guard = guard
        self.deadline = _Deadline()
        self.response_class = functools.partial(_DeadlineResponse, deadline=self.deadline)

    def connect(self) -> None:
        sock = _open_vetted(self.guard, self.host, self.port, self.deadline)
        try:
            # SNI and certificate checks use the hostname; the socket is the vetted IP.
            self.sock = self._context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


_Connection = _GuardedHTTPConnection | _GuardedHTTPSConnection
_PoolKey = tuple[str, str, int]  # an Origin


def _looks_closed(conn: _Connection) -> bool:
    """True when an idle connection has something to read: EOF (server closed) or junk."""
    sock = conn.sock
    if sock is None:
        return True
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        if hasattr(select, "poll"):  # poll has no FD_SETSIZE limit, unlike select
            poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True


class _ConnectionPool:
    """Idle keep-alive connections, most recently used first, bounded per key and in all."""

    def __init__(self, per_key: int, total: int) -> None:
        self._per_key = per_key
        self._total = total
        self._idle: OrderedDict[_PoolKey, list[tuple[_Connection, float]]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self._closed = False

    def get(self, key: _PoolKey) -> _Connection | None:
        while True:
            with self._lock:
                entries = self._idle.get(key)
                if not entries:
                    return None
                conn, since = entries.pop()
                self._count -= 1
                if not entries:
                    del self._idle[key]
            if time.monotonic() - since < _IDLE_MAX_AGE and not _looks_closed(conn):
                return conn
            conn.close()

    def put(self, key: _PoolKey, conn: _Connection) -> None:
        evicted: list[_Connection] = []
        with self._lock:
            if self._closed:
                evicted.append(conn)
            else:
                entries = self._idle.setdefault(key, [])
                self._idle.move_to_end(key)
                entries.append((conn, time.monotonic()))
                self._count += 1
                if len(entries) > self._per_key:
                    evicted.append(entries.pop(0)[0])
                    self._count -= 1
                while self._count > self._total:
                    evicted.append(self._pop_oldest())
        for old in evicted:
            old.close()

    def _pop_oldest(self) -> _Connection:
        key, entries = next(iter(self._idle.items()))  # least recently used key
        conn = entries.pop(0)[0]
        self._count -= 1
        if not entries:
            del self._idle[key]
        return conn

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for entries in self._idle.values() for c, _ in entries]
            self._idle.clear()
            self._count = 0
        for conn in conns:
            conn.close()


# --------------------------------------------------------------------------- outcomes


class _Failure(Exception):
    """A finished, non-OK outcome raised from deep inside a request."""

    def __init__(self, status: Status, error: str, http_status: int | None = None,
                 retryable: bool = False, retry_after: float | None = None,
                 opt_out_reason: str | None = None) -> None:
        super().__init__(error)
        self.result = FetchResult(status, _short(error), http_status=http_status,
                                  opt_out_reason=opt_out_reason)
        self.retryable = retryable
        self.retry_after = retry_after


@dataclass
class _Redirect:
    location: str
    http_status: int


@dataclass
class _Target:
    url: str
    scheme: str
    host: str
    port: int
    path: str  # request target: path plus query, ASCII

    @property
    def key(self) -> Origin:
        return (self.scheme, self.host, self.port)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _describe(err: BaseException) -> str:
    detail = str(err)
    return f"{type(err).__name__}: {detail}" if detail else type(err).__name__


def _parse_target(url: str) -> _Target:
    """Split an http(s) URL; raise _Failure(INVALID_URL) for anything unusable."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        host = parts.hostname
    except ValueError as err:
        raise _Failure(Status.INVALID_URL, f"unparsable URL: {err}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _Failure(Status.INVALID_URL, f"unsupported scheme {scheme or '(none)'!r}")
    if not host:
        raise _Failure(Status.INVALID_URL, "URL has no host")
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")  # Host header and DNS need ASCII
        except UnicodeError:
            raise _Failure(Status.INVALID_URL, f"invalid host name {host!r}") from None
    path = urllib.parse.quote(parts.path or "/", safe=_URL_SAFE)
    if parts.query:
        path += "?" + urllib.parse.quote(parts.query, safe=_URL_SAFE)
    port = port or (443 if scheme == "https" else 80)
    return _Target(url=url, scheme=scheme, host=host, port=port, path=path)


def _connection_failure(err: BaseException) -> _Failure:
    """Map an exception raised while talking to a server to a status."""
    if isinstance(err, BlockedAddress):
        return _Failure(Status.BLOCKED_ADDRESS, str(err))
    if isinstance(err, TimeoutError):
        return _Failure(Status.TIMEOUT, "timed out connecting or waiting for the response")
    if isinstance(err, socket.gaierror):
        return _Failure(Status.DOWNLOAD_ERROR, f"DNS lookup failed: {err}")
    if isinstance(err, ssl.SSLCertVerificationError):
        return _Failure(Status.DOWNLOAD_ERROR, f"TLS certificate: {err.verify_message}")
    # Refused/reset connections and bodies cut short are often transient: retry them.
    retryable = isinstance(err, ConnectionError | http.client.IncompleteRead)
    if isinstance(err, http.client.HTTPException):
        return _Failure(Status.DOWNLOAD_ERROR, f"bad response: {_describe(err)}",
                        retryable=retryable)
    return _Failure(Status.DOWNLOAD_ERROR, _describe(err), retryable=retryable)


# --------------------------------------------------------------------------- the fetcher


class Fetcher:
    """Thread-safe HTTP(S) downloader; see the module docstring for what it guarantees.

    ``gate``: consent and pacing per origin (none: every URL may be fetched at once);
    ``hosts``: the per-host politeness it applies (default: the per-task rule, its own);
    ``truncate``: a body over ``max_bytes`` is cut there instead of failing TOO_LARGE
    (robots.txt: its first 500 KiB are parsed); ``accept``: the Accept header.
    """

    def __init__(self, cfg: DownloadConfig, *, ssl_context: ssl.SSLContext | None = None,
                 max_idle_connections: int = 256, gate: RequestGate | None = None,
                 hosts: HostPolicy | None = None, truncate: bool = False,
                 accept: str = IMAGE_ACCEPT) -> None:
        self.cfg = cfg
        self.gate = gate
        self.truncate = truncate
        self.guard = AddressGuard(cfg.allow_addresses)
        # One verifying context for every connection (wrap_socket is thread-safe), made at
        # the first https URL: loading the CA store costs ~60 ms of CPU per shard task.
        self._ssl_context = ssl_context
        self._ssl_lock = threading.Lock()
        self._pool = _ConnectionPool(cfg.per_host_connections, max_idle_connections)
        self.hosts = hosts if hosts is not None else HostPolicy(cfg)
        self._agents = [AGENT_NAME, cfg.agent_token]
        self._headers = {"User-Agent": cfg.user_agent, "Accept": accept}

    # public -------------------------------------------------------------------------

    def fetch(self, url: str) -> FetchResult:
        """Download ``url``; every failure comes back as a status, never an exception."""
        try:
            return self._fetch(url)
        except _Failure as failure:
            return failure.result
        except Exception as err:  # a bug or an exotic failure must not kill the shard
            return FetchResult(Status.DOWNLOAD_ERROR, _short(f"unexpected {_describe(err)}"))

    def close(self) -> None:
        """Close idle connections (in-flight requests finish and close theirs) and give
        the hosts' leases back."""
        self._pool.close()
        self.hosts.close()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # URL level ----------------------------------------------------------------------

    def _fetch(self, url: str) -> FetchResult:
        if not isinstance(url, str) or not url.strip():
            return FetchResult(Status.INVALID_URL, "empty URL")
        url = url.strip()
        if url[:5].lower() == "file:":
            return self._read_file(url)
        target = _parse_target(url)
        seen = {target.url}
        for _ in range(self.cfg.max_redirects + 1):
            refused = self.gate.admit(target.url, target.key) if self.gate else None
            if refused is not None:  # every hop asks: a redirect may lead to another host
                refused.final_url = target.url
                return refused
            try:
                outcome = self._polite_get(target)
            except _Failure as failure:
                failure.result.final_url = target.url
                return failure.result
            if isinstance(outcome, FetchResult):
                outcome.final_url = target.url
                return outcome
            try:
                target = self._follow(target, outcome, seen)
            except _Failure as failure:
                failure.result.final_url = target.url
                return failure.result
        return FetchResult(Status.TOO_MANY_REDIRECTS,
                           f"more than {self.cfg.max_redirects} redirects",
                           http_status=outcome.http_status, final_url=target.url)

    def _follow(self, target: _Target, redirect: _Redirect, seen: set[str]) -> _Target:
        next_url = urllib.parse.urljoin(target.url, redirect.location.strip())
        next_url = urllib.parse.urldefrag(next_url)[0]
        scheme = urllib.parse.urlsplit(next_url).scheme.lower()
        if scheme == "file":
            # A remote server must never make us read a local file.
            raise _Failure(Status.BLOCKED_ADDRESS, f"redirect to a file: URL ({next_url})",
                           http_status=redirect.http_status)
        if next_url in seen:
            raise _Failure(Status.TOO_MANY_REDIRECTS, f"redirect loop at {next_url}",
                           http_status=redirect.http_status)
        seen.add(next_url)
        return _parse_target(next_url)

    def _read_file(self, url: str) -> FetchResult:
        if not self.cfg.allow_file_scheme:
            return FetchResult(Status.INVALID_URL,
                               "file: URLs are disabled (download.allow_file_scheme)")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            return FetchResult(Status.INVALID_URL, f"file: URL with a host ({parts.netloc})")
        path = urllib.request.url2pathname(parts.path)  # also undoes %-escapes
        cap = self.cfg.max_bytes
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size > cap:
                    return FetchResult(Status.TOO_LARGE, f"file over {cap} bytes",
                                       final_url=url)
                body = handle.read(cap + 1)  # size can lie (pipes, /proc): cap the read
        except OSError as err:
            return FetchResult(Status.DOWNLOAD_ERROR, _short(_describe(err)), final_url=url)
        if len(body) > cap:
            return FetchResult(Status.TOO_LARGE, f"file over {cap} bytes", final_url=url)
        return FetchResult(Status.OK, None, body=body, final_url=url)

    # request level ------------------------------------------------------------------

    def _polite_get(self, target: _Target) -> FetchResult | _Redirect:
        """One hop through the host's circuit breaker: its outcome is recorded there."""
        try:
            probe = self.hosts.enter(target.host)
        except HostGivenUp:
            self.hosts.count(target.host, "rows_host_paused")
            raise _Failure(Status.HOST_PAUSED, f"{target.host} failed "
                           f"{self.cfg.host_failures} rows in a row through "
                           f"{self.cfg.host_max_pauses} pauses: given up "
                           "(download.host_failures)") from None
        transient = True  # until the hop ends otherwise (an exception that escapes too)
        try:
            outcome = self._get_with_retries(target)
            transient = False
            return outcome
        except _Failure as failure:
            transient = is_transient(failure.result.status, failure.result.http_status,
                                     failure.retryable)
            raise
        finally:
            self.hosts.record(target.host, transient, probe)

    def _get_with_retries(self, target: _Target) -> FetchResult | _Redirect:
        tries = self.cfg.retries + 1
        for attempt in range(tries):
            try:
                return self._attempt(target)
            except _Failure as failure:
                if not failure.retryable:
                    raise
                delay = self._retry_delay(failure, attempt)
                if attempt + 1 >= tries:
                    if tries > 1:
                        failure.result.error = _short(
                            f"{failure.result.error} (after {tries} tries)")
                    raise
                self.hosts.count(target.host, "backoffs")
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _retry_delay(self, failure: _Failure, attempt: int) -> float:
        if failure.retry_after is None:
            return full_jitter(self.cfg.backoff, attempt)
        if failure.retry_after > self.cfg.max_retry_after:
            failure.retryable = False
            failure.result.error = _short(
                f"{failure.result.error}: Retry-After {failure.retry_after:g} s is over "
                f"download.max_retry_after ({self.cfg.max_retry_after:g} s), giving up")
            raise failure
        return failure.retry_after

    def _attempt(self, target: _Target) -> FetchResult | _Redirect:
        """One request/response exchange, holding one of the host's slots throughout."""
        with self.hosts.slot(target.host):
            spacing = self.gate.spacing(target.key) if self.gate else 0.0
            # inside the slot: the rate and the spacing hold on the wire; a host whose
            # run-wide rate took the spacing in is not paced again per node
            if not self.hosts.take_token(target.host, spacing) and self.gate:
                self.gate.pace(target.key)
            deadline_at = time.monotonic() + self.cfg.timeout
            conn, response = self._send(target, deadline_at)
            try:
                outcome = self._handle(target, conn, response)
            except BaseException:
                # the response was not read to its end: the connection cannot be reused
                response.close()
                conn.close()
                raise
        if isinstance(outcome, _Failure):
            raise outcome  # a failure whose connection went back to the pool
        return outcome

    def _send(self, target: _Target,
              deadline_at: float) -> tuple[_Connection, http.client.HTTPResponse]:
        conn = self._pool.get(target.key)
        if conn is not None:
            try:
                return conn, self._exchange(conn, target, deadline_at)
            except (ConnectionError, http.client.BadStatusLine):
                # The server closed the idle connection as we reused it: nothing was
                # processed, so one more try on a fresh connection is safe for a GET.
                conn.close()
            except BaseException as err:
                conn.close()
                raise _connection_failure(err) from None
        conn = self._new_connection(target)
        try:
            return conn, self._exchange(conn, target, deadline_at)
        except BaseException as err:
            conn.close()
            raise _connection_failure(err) from None

    def _new_connection(self, target: _Target) -> _Connection:
        if target.scheme == "https":
            return _GuardedHTTPSConnection(target.host, target.port, self.guard,
                                           self._tls_context())
        return _GuardedHTTPConnection(target.host, target.port, self.guard)

    def _tls_context(self) -> ssl.SSLContext:
        with self._ssl_lock:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            return self._ssl_context

    def _exchange(self, conn: _Connection, target: _Target,
                  deadline_at: float) -> http.client.HTTPResponse:
        conn.deadline.at = deadline_at
        if conn.sock is not None:
            conn.sock.settimeout(conn.deadline.remaining())
        conn.request("GET", target.path, headers=self._headers)
        return conn.getresponse()

    def _handle(self, target: _Target, conn: _Connection,
                response: http.client.HTTPResponse) -> FetchResult | _Redirect | _Failure:
        """Classify a response; raising means the connection must be closed."""
        code = response.status
        if code in REDIRECT_CODES:
            location = response.getheader("Location")
            self._release(target, conn, response)
            if not location:
                return _Failure(Status.HTTP_ERROR, f"HTTP {code} without Location",
                                http_status=code)
            return _Redirect(location, code)
        if code == 429 or code >= 500:
            retry_after = parse_retry_after(response.getheader("Retry-After"))
            self._release(target, conn, response)
            return _Failure(Status.HTTP_ERROR, f"HTTP {code}", http_status=code,
                            retryable=True, retry_after=retry_after)
        if not 200 <= code < 300:
            self._release(target, conn, response)
            return _Failure(Status.HTTP_ERROR, f"HTTP {code}", http_status=code)
        self._check_robots(response, code)
        self._check_length(response, code)
        body = self._read_body(response, code)
        self._release(target, conn, response)
        return FetchResult(Status.OK, None, body=body, http_status=code)

    def _check_robots(self, response: http.client.HTTPResponse, code: int) -> None:
        if self.cfg.tdm and (response.getheader("tdm-reservation") or "").strip() == "1":
            raise _Failure(Status.OPTED_OUT, "tdm-reservation: 1 (TDM rights reserved)",
                           http_status=code, opt_out_reason="tdm")
        if not self.cfg.respect_robots:
            return
        values = response.headers.get_all("X-Robots-Tag") or []
        hit = robots_opt_out(values, self.cfg.robots_directives, self._agents)
        if hit is not None:
            raise _Failure(Status.OPTED_OUT, f"X-Robots-Tag: {hit}", http_status=code,
                           opt_out_reason="x_robots_tag")

    def _check_length(self, response: http.client.HTTPResponse, code: int) -> None:
        if self.truncate:
            return  # the body is cut at the cap instead
        length = response.getheader("Content-Length")
        if length and length.strip().isdigit() and int(length) > self.cfg.max_bytes:
            raise _Failure(Status.TOO_LARGE,
                           f"Content-Length {int(length)} over {self.cfg.max_bytes} bytes",
                           http_status=code)

    def _read_body(self, response: http.client.HTTPResponse, code: int) -> bytes:
        cap = self.cfg.max_bytes
        body = bytearray()
        try:
            if response.length is not None and response.length <= cap:
                # Content-Length, checked against the cap: one read of exactly that
                # many bytes into one buffer (a short body raises IncompleteRead).
                return response.read()
            while True:
                # Never ask for more than one byte past the cap.
                data = response.read(min(_CHUNK, cap + 1 - len(body)))
                if not data:
                    return bytes(body)
                body += data
                if len(body) > cap and self.truncate:
                    response.will_close = True  # the rest is unread: the connection goes
                    response.close()
                    return bytes(body[:cap])
                if len(body) > cap:
                    raise _Failure(Status.TOO_LARGE, f"body over {cap} bytes",
                                   http_status=code)
        except TimeoutError:
            raise _Failure(Status.TIMEOUT,
                           f"timed out after {self.cfg.timeout:g} s reading the body",
                           http_status=code) from None
        except _Failure:
            raise
        except Exception as err:
            failure = _connection_failure(err)
            failure.result.http_status = code
            raise failure from None

    def _release(self, target: _Target, conn: _Connection,
                 response: http.client.HTTPResponse) -> None:
        """Return a connection to the pool if its response is fully read, else close it."""
        if not response.isclosed():
            self._drain(response)
        if response.isclosed() and not response.will_close and conn.sock is not None:
            self._pool.put(target.key, conn)
        else:
            response.close()
            conn.close()

    @staticmethod
    def _drain(response: http.client.HTTPResponse) -> None:
        """Read a small leftover body (error pages, redirects) so keep-alive survives."""
        length = response.length
        if length is not None and length > _DRAIN_LIMIT:
            return
        try:
            read = 0
            while read <= _DRAIN_LIMIT:
                data = response.read(_CHUNK)
                if not data:
                    return
                read += len(data)
        except Exception:
            return  # the caller closes a connection whose response is not closed
