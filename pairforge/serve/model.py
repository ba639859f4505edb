"""The service's model deployment: the cache and the checked captioner, behind a handle.

``CaptionModel`` receives batches of decoded uploads from the ingress (serve/app.py) and
answers each from ``ReplicaCaptioner`` (serve/captioning.py): its cache first, then the
batch step's ``CheckedCaptioner``. It holds no HTTP, no body parsing and no image pass,
so its process spends its interpreter on the model; it reserves ``process.recaption``'s
CPUs, GPUs and resources and scales on its own (``serve.replicas`` or
``serve.min_replicas``/``max_replicas``), while the ingress scales with
``serve.ingress_replicas``.

Batches that arrive while the model is busy are merged into its next call, up to
``max_batch_size`` uploads. Serve's ``@serve.batch`` (in the ingress) closes a batch
``batch_wait_timeout_s`` after its first request whether or not the model is free, so
under load it sends many small batches; merging them where the model is makes every call
under load a full one, and joins the batches of several ingress replicas.

The models load in the constructor: Serve sends a replica nothing before it is built, so a
replica added by the autoscaler never answers "not ready", and one whose models fail to
load is reported by ``serve status`` (and by ``pairforge serve`` at start).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ray import serve

from pairforge.config import ClipConfig, RecaptionConfig, ServeConfig
from pairforge.pipeline.ray_private import bind_replica_grpc_to_node
from pairforge.serve.captioning import Answer, ReplicaCaptioner
from pairforge.serve.inputs import Upload

MODEL_DEPLOYMENT = "CaptionModel"
log = logging.getLogger("pairforge.serve")
T, R = TypeVar("T"), TypeVar("R")


@dataclass(frozen=True)
class ModelReply:
    """A batch's answers in order, or why there are none (the backend failed)."""

    answers: list[Answer] | None
    cache_entries: int  # captions in this replica's cache after the call
    # uploads per model call, for calls no reply has reported yet: each call is reported
    # once, to whichever caller is answered next, so the callers' counts add up exactly
    calls: list[int] = field(default_factory=list)
    failure: str | None = None


@dataclass
class _Waiting(Generic[T]):
    items: list[T]
    done: asyncio.Future[tuple[list | None, list[int], str | None]]


class MergingCaller(Generic[T, R]):
    """Calls ``fn`` (blocking) on its own thread, one call at a time, over the batches that
    wait for it, merged oldest first while they fit in ``max_size`` items (a larger batch
    goes alone)."""

    def __init__(self, fn: Callable[[list[T]], list[R]], max_size: int) -> None:
        self.fn, self.max_size = fn, max_size
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="pairforge-model")
        self.waiting: list[_Waiting[T]] = []
        self.calling: asyncio.Task | None = None  # held: the loop keeps weak references
        self.unreported: list[int] = []

    async def __call__(self, items: list[T]) -> tuple[list[R] | None, list[int], str | None]:
        """``fn``'s results for ``items`` (None if it raised), the sizes of calls not
        reported before, and the failure."""
        waiting = _Waiting(items, asyncio.get_running_loop().create_future())
        self.waiting.append(waiting)
        if self.calling is None:
            self.calling = asyncio.create_task(self._call_while_waiting())
        return await waiting.done

    async def _call_while_waiting(self) -> None:
        try:
            while batches := self._next_call():
                await self._call(batches)
        finally:
            self.calling = None

    def _next_call(self) -> list[_Waiting[T]]:
        self.waiting = [w for w in self.waiting if not w.done.done()]  # callers gone
        taken, size = [], 0
        while self.waiting and (not taken or
                                size + len(self.waiting[0].items) <= self.max_size):
            size += len(self.waiting[0].items)
            taken.append(self.waiting.pop(0))
        return taken

    async def _call(self, batches: list[_Waiting[T]]) -> None:
        items = [item for batch in batches for item in batch.items]
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.thread, self.fn, items)
            failure = None
        except Exception as err:  # the backend (a server, the device) failed: try later
            log.exception("captioning a batch failed")
            results, failure = None, f"the captioning backend failed: " \
                                     f"{type(err).__name__}: {err}"
        self.unreported.append(len(items))
        start = 0
        for batch in batches:
            mine = None if results is None else results[start:start + len(batch.items)]
            start += len(batch.items)
            if not batch.done.done():  # a caller that gave up has cancelled its future
                batch.done.set_result((mine, self.unreported, failure))
                self.unreported = []


@serve.deployment(name=MODEL_DEPLOYMENT)
class CaptionModel:
    def __init__(self, serve: ServeConfig, recaption: RecaptionConfig, clip: ClipConfig) -> None:
        bind_replica_grpc_to_node()  # before Serve starts this replica's gRPC server
        self.captioner = ReplicaCaptioner(recaption, clip, serve.cache)
        self.captioner.load()
        self.call = MergingCaller(self.captioner.caption, serve.max_batch_size)

    def ready(self) -> str:
        """Answers once the replica is built, i.e. its models are loaded."""
        return "ready"

    async def caption(self, uploads: list[Upload]) -> ModelReply:
        answers, calls, failure = await self.call(uploads)
        return ModelReply(answers, len(self.captioner.cache), calls, failure)
