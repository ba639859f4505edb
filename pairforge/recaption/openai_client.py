"""The OpenAI-compatible chat-completions client: a bounded number of requests in flight.

One client per actor holds ``openai.concurrency`` slots on its own asyncio event loop (a
daemon thread). Any thread submits request bodies and waits for its own answers; the slots
are shared, so the batches an actor works on at once (recaption/step.py runs several when
the pool allows it) keep the server fed while one batch waits for its slowest request.
Before, each batch ran its own thread pool and waited for all its answers: one slow
request held every slot of its batch idle.

A request that fails after its retries is that row's answer, not the batch's exception:
``Failure("http_500")``, ``Failure("timeout")``, ``Failure("connection_error")``,
``Failure("bad_response")`` (not JSON, or no ``choices[0].message.content`` string) or
``Failure("http_400")``-style for other per-request refusals. Only answers that mean every
request would fail (401, 403, 404: a wrong key, URL or model name) raise
:class:`ServerRefused`, because a build that swallowed them would silently caption nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pairforge.backoff import backoff_seconds
from pairforge.config import OpenAIServerConfig

# Batches one actor works on at once, per batch the slots could hold: a batch whose other
# answers are back holds one slot while its slowest request runs, so the slots need many
# more batches queued than concurrency / batch_size to stay full. Against a server with
# a 10x tail on every 10th request (bench/openai_client.py, C=32), 4x reached 0.79 of
# C / mean latency at batch_size 8 and 0.59 at 32; 8x reached 0.94 and 0.97.
BATCHES_PER_SLOT_FILL = 8
MAX_BATCHES_IN_FLIGHT = 128  # threads of one actor; past it, raise batch_size


def batches_in_flight(concurrency: int, batch_size: int) -> int:
    """Batches an actor works on at once to keep ``concurrency`` requests in flight."""
    wanted = -(-BATCHES_PER_SLOT_FILL * concurrency // batch_size)
    return max(2, min(MAX_BATCHES_IN_FLIGHT, wanted))


RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# every request would get the same answer: a configuration error, raised, not a row's status
FATAL_STATUS = frozenset({401, 403, 404})


@dataclass(frozen=True)
class Failure:
    """A row whose request failed after its retries; ``reason`` is short and stable (it
    becomes the flag ``failed:REASON``), ``detail`` is for people."""

    reason: str
    detail: str = ""


Answer = str | Failure


class ServerRefused(RuntimeError):
    """The server refuses every request (401, 403, 404): the URL, key or model is wrong."""


def reply_text(payload: bytes) -> str | None:
    """The caption text of a chat-completions reply, or None when the reply is not one."""
    try:
        content = json.loads(payload)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if content is None:  # a server may answer null content for an empty generation
        return ""
    return content if isinstance(content, str) else None


class ChatClient:
    """``concurrency`` requests in flight at most, across every calling thread."""

    def __init__(self, server: OpenAIServerConfig, url: str,
                 headers: dict[str, str] | None = None) -> None:
        self.server, self.url, self.headers = server, url, dict(headers or {})
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="openai-client")
        self._thread.start()
        self._session: Any = None
        self._slots = self._run(self._start()).result()

    async def _start(self) -> asyncio.Semaphore:
        import aiohttp

        # the connector's limit matches the slots: no request waits for a socket it holds
        connector = aiohttp.TCPConnector(limit=self.server.concurrency)
        self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return asyncio.Semaphore(self.server.concurrency)

    def _run(self, coroutine: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def submit(self, body: dict[str, Any]) -> Future:
        """A future of the body's :data:`Answer` (it raises only :class:`ServerRefused`)."""
        return self._run(self._request(body))

    def complete(self, bodies: list[dict[str, Any]]) -> list[Answer]:
        """The answers of ``bodies``, in order; waits for all of them."""
        futures = [self.submit(body) for body in bodies]
        return [f.result() for f in futures]

    async def _request(self, body: dict[str, Any]) -> Answer:
        retries = self.server.retries
        failure = Failure("unreachable")
        for attempt in range(retries + 1):
            retry, failure, retry_after = await self._attempt(body)
            if not retry:
                return failure
            if attempt < retries:
                # outside the slot: meanwhile the server gets another request
                await asyncio.sleep(backoff_seconds(attempt, retry_after))
        return failure

    async def _attempt(self, body: dict[str, Any]) -> tuple[bool, Answer, str | None]:
        """(whether to retry, the answer or failure so far, the server's Retry-After)."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.server.timeout_s)
        async with self._slots:
            try:
                async with self._session.post(self.url, json=body, timeout=timeout) as response:
                    status, payload = response.status, await response.read()
                    retry_after = response.headers.get("Retry-After")
            except TimeoutError:
                return True, Failure("timeout", f"no answer in {self.server.timeout_s:g} s"), None
            except aiohttp.ClientError as error:
                return True, Failure("connection_error", str(error)), None
        retry, answer = self._judge(status, payload)
        return retry, answer, retry_after

    def _judge(self, status: int, payload: bytes) -> tuple[bool, Answer]:
        detail = payload[:200].decode("utf-8", "replace")
        if status in FATAL_STATUS:
            raise ServerRefused(f"{self.url} answered HTTP {status} ({detail}); check "
                                f"openai.base_url, the model name and ${self.server.api_key_env}")
        if status != 200:
            return status in RETRY_STATUS, Failure(f"http_{status}", detail)
        text = reply_text(payload)
        return False, (Failure("bad_response", detail) if text is None else text)

    def close(self) -> None:
        """Close the connections and stop the loop (the actor is going away)."""
        if not self.loop.is_running():
            return
        if self._session is not None:
            self._run(self._session.close()).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
