"""The download stage's ``Fetcher`` on urllib3: the measured alternative of issue 33, item 7.

Everything above one HTTP exchange is ``pairforge.download.fetch.Fetcher``'s own (URL
checks, file: URLs, redirects with their count and loop check, retries with backoff and
Retry-After, the per-host slot), so the two clients differ only where urllib3 would take
over: connections, their pool and keep-alive, the request, the response and TLS.
urllib3 is given what the stage's contract needs and urllib3 does not offer:

* the address guard at connect time: a connection class whose ``_new_conn`` connects to
  the address ``AddressGuard`` vetted (urllib3's own resolves the name again);
* a whole-request deadline: urllib3's ``Timeout`` bounds each socket operation, so a body
  trickled a byte at a time never trips it; the connection's ``response_class`` is
  fetch.py's deadline response, whose every read waits only until the request's end;
* one retry of a request that a reused keep-alive connection lost (the server closed it
  as we sent): with urllib3's retries off (our own retry loop decides) urllib3 does not
  retry it, so the connection records whether it was reused;
* a bounded drain: ``HTTPResponse.drain_conn`` reads any error body to its end.

bench/fetch_compare.py measures it against fetch.py's client; tests/test_fetch.py runs
against it with ``PAIRFORGE_TEST_FETCHER=urllib3``.
"""

from __future__ import annotations

import functools
import http.client
import threading
import time
from collections import OrderedDict

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ProtocolError, SSLError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from pairforge.backoff import parse_retry_after
from pairforge.download.address_guard import BlockedAddress
from pairforge.download.fetch import (
    _CHUNK,
    _DRAIN_LIMIT,
    REDIRECT_CODES,
    Fetcher,
    FetchResult,
    _connection_failure,
    _DeadlineResponse,
    _Failure,
    _open_vetted,
    _Redirect,
    _Target,
    robots_opt_out,
)
from pairforge.records import Status

_local = threading.local()  # the calling thread's request: its deadline, its connection


class _ThreadDeadline:
    """The current request's end, per thread: urllib3 picks the connection inside
    ``urlopen``, after the deadline is known, and lends it to one thread at a time."""

    def remaining(self) -> float:
        left = _local.deadline_at - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left


_DEADLINE = _ThreadDeadline()


class _GuardedMixin:
    """Connect to the vetted address; note whether a request went out on a reused socket."""

    response_class = functools.partial(_DeadlineResponse, deadline=_DEADLINE)
    _used = False

    def __init__(self, *args, guard, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def _new_conn(self):
        return _open_vetted(self.guard, self.host, self.port, _DEADLINE)

    def request(self, *args, **kwargs) -> None:
        _local.reused = self._used and self.sock is not None
        self._used = True
        super().request(*args, **kwargs)

    def close(self) -> None:
        self._used = False
        super().close()


class _GuardedHTTPConnection(_GuardedMixin, HTTPConnection):
    pass


class _GuardedHTTPSConnection(_GuardedMixin, HTTPSConnection):
    pass


class _GuardedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _GuardedHTTPConnection


class _GuardedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _GuardedHTTPSConnection


def _unwrap(err: BaseException) -> BaseException:
    """The exception urllib3 wrapped (ProtocolError, SSLError, its timeouts), for statuses."""
    while isinstance(err, ProtocolError | SSLError) and err.args \
            and isinstance(err.args[-1], BaseException):
        err = err.args[-1]
    if isinstance(err, Urllib3Timeout):
        return TimeoutError(str(err))
    return err


def _is_stale(err: BaseException) -> bool:
    return isinstance(err, ConnectionError | http.client.BadStatusLine)


class Urllib3Fetcher(Fetcher):
    """``Fetcher`` with urllib3 connection pools, one per (scheme, host, port)."""

    def __init__(self, *args, max_idle_connections: int = 256, **kwargs) -> None:
        super().__init__(*args, max_idle_connections=max_idle_connections, **kwargs)
        # urllib3 keeps up to maxsize idle connections per pool; bound the pools so the
        # idle total stays near the hand-written pool's max_idle_connections.
        self._max_pools = max(1, max_idle_connections // self.cfg.per_host_connections)
        self._pools: OrderedDict[tuple[str, str, int], HTTPConnectionPool] = OrderedDict()
        self._pools_lock = threading.Lock()

    def close(self) -> None:
        with self._pools_lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.close()

    def _pool_for(self, target: _Target) -> HTTPConnectionPool:
        evicted = None
        with self._pools_lock:  # making a pool opens nothing: cheap under the lock
            pool = self._pools.get(target.key)
            if pool is not None:
                self._pools.move_to_end(target.key)
                return pool
            kwargs = {"maxsize": self.cfg.per_host_connections, "block": False,
                      "retries": False, "guard": self.guard}
            if target.scheme == "https":
                pool = _GuardedHTTPSPool(target.host, target.port,
                                         ssl_context=self._tls_context(), **kwargs)
            else:
                pool = _GuardedHTTPPool(target.host, target.port, **kwargs)
            self._pools[target.key] = pool
            if len(self._pools) > self._max_pools:
                evicted = self._pools.popitem(last=False)[1]  # least recently used
        if evicted is not None:
            evicted.close()  # idle connections now; lent ones close when handed back
        return pool

    def _attempt(self, target: _Target) -> FetchResult | _Redirect:
        with self.hosts.slot(target.host):
            _local.deadline_at = time.monotonic() + self.cfg.timeout
            response = self._send(target)
            try:
                outcome = self._handle(response)
            except BaseException:
                response.close()  # also closes the connection: its body was not read
                response.release_conn()
                raise
        if isinstance(outcome, _Failure):
            raise outcome
        return outcome

    def _send(self, target: _Target) -> urllib3.BaseHTTPResponse:
        pool = self._pool_for(target)
        for last in (False, True):
            _local.reused = False
            try:
                return pool.urlopen("GET", target.path, headers=self._headers, retries=False,
                                    redirect=False, assert_same_host=False,
                                    timeout=self.cfg.timeout, preload_content=False,
                                    decode_content=False)
            except BlockedAddress as err:
                raise _connection_failure(err) from None
            except Exception as err:
                inner = _unwrap(err)
                if last or not (_local.reused and _is_stale(inner)):
                    raise _connection_failure(inner) from None
                # the server closed the idle connection as we reused it: once more, fresh
        raise AssertionError("unreachable")

    def _handle(self, response: urllib3.BaseHTTPResponse
                ) -> FetchResult | _Redirect | _Failure:
        code = response.status
        if code in REDIRECT_CODES:
            location = response.headers.get("Location")
            self._release(response)
            if not location:
                return _Failure(Status.HTTP_ERROR, f"HTTP {code} without Location",
                                http_status=code)
            return _Redirect(location, code)
        if code == 429 or code >= 500:
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            self._release(response)
            return _Failure(Status.HTTP_ERROR, f"HTTP {code}", http_status=code,
                            retryable=True, retry_after=retry_after)
        if not 200 <= code < 300:
            self._release(response)
            return _Failure(Status.HTTP_ERROR, f"HTTP {code}", http_status=code)
        self._check_robots(response, code)
        self._check_length(response, code)
        body = self._read_body(response, code)
        self._release(response)
        return FetchResult(Status.OK, None, body=body, http_status=code)

    def _check_robots(self, response, code: int) -> None:
        if not self.cfg.respect_robots:
            return
        values = response.headers.getlist("X-Robots-Tag")
        hit = robots_opt_out(values, self.cfg.robots_directives, self._agents)
        if hit is not None:
            raise _Failure(Status.OPTED_OUT, f"X-Robots-Tag: {hit}", http_status=code)

    def _check_length(self, response, code: int) -> None:
        length = response.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > self.cfg.max_bytes:
            raise _Failure(Status.TOO_LARGE,
                           f"Content-Length {int(length)} over {self.cfg.max_bytes} bytes",
                           http_status=code)

    def _read_body(self, response, code: int) -> bytes:
        cap = self.cfg.max_bytes
        body = bytearray()
        try:
            if response.length_remaining is not None and response.length_remaining <= cap:
                return response.read()
            while True:
                data = response.read(min(_CHUNK, cap + 1 - len(body)))
                if not data:
                    return bytes(body)
                body += data
                if len(body) > cap:
                    raise _Failure(Status.TOO_LARGE, f"body over {cap} bytes",
                                   http_status=code)
        except _Failure:
            raise
        except Exception as err:
            inner = _unwrap(err)
            if isinstance(inner, TimeoutError):
                raise _Failure(Status.TIMEOUT,
                               f"timed out after {self.cfg.timeout:g} s reading the body",
                               http_status=code) from None
            failure = _connection_failure(inner)
            failure.result.http_status = code
            raise failure from None

    @staticmethod
    def _release(response) -> None:
        """Read a small leftover body so keep-alive survives; close the connection else.

        urllib3 hands the connection back to its pool once the body is read to its end.
        """
        length = response.length_remaining
        if length is None or length <= _DRAIN_LIMIT:
            try:
                read = 0
                while read <= _DRAIN_LIMIT:
                    data = response.read(_CHUNK)
                    if not data:
                        return
                    read += len(data)
            except Exception:
                pass  # the error handler closed and released the connection
        response.close()
        response.release_conn()

