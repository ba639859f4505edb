"""Generate calls shared by the batches an actor holds: no pass of retries on its own.

A caption the checks send back (empty, not fluent, an ungrounded noun) is generated again
under the strict prompt. Generated batch by batch, those retries would be a second, short
``generate`` after each batch: a barrier where the device runs a few rows while the next
batch waits. Here every thread of the actor (the recaption step works on
``concurrent_batches`` batches at once) hands its rows, first tries and retries alike, to
one queue, and a call takes up to ``batch_size`` of them, oldest first, each with its own
prompt (backends.Prompts): a batch's retries ride in the same call as another batch's
rows. A call starts when it can be filled, or when no caller could add a row to it (every
thread that may submit is blocked here on rows not yet generated), so a lone batch never
waits for company.

Rows are answered in the order they came; a caller returns when its own rows are. Greedy
decoding gives a row the same text whatever rows ride beside it (the backends' tests: a
batch equals its images one by one, under one prompt or mixed prompts), so the checks'
outcome and the caption do not depend on how the calls were filled. Out of memory, a call
runs again at half the rows, kept from then on (``batching.Halving``); at one row the
error reaches every caller of that call.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from PIL import Image

from pairforge.batching import Halving
from pairforge.recaption.openai_client import Answer

Generate = Callable[[list[Image.Image], list[str]], list[Answer]]


@dataclass(eq=False)
class _Row:
    image: Image.Image
    prompt: str
    answer: Answer | None = None
    error: BaseException | None = None
    done: bool = False


class SharedGenerate:
    """One queue of (image, prompt) rows for every thread of an actor, generated in calls
    of at most ``rows`` rows (see the module's docstring)."""

    def __init__(self, generate: Generate, rows: int, what: str = "recaption") -> None:
        self.generate = generate
        self.size = Halving(rows, what)
        self.cond = threading.Condition()
        self.pending: deque[_Row] = deque()
        self.callers = 0  # threads inside ``caller()``: they may still submit rows
        self.waiting: dict[object, list[_Row]] = {}  # each ``answers`` call's rows
        self.running = False

    @contextlib.contextmanager
    def caller(self) -> Iterator[None]:
        """While inside, this thread counts as one that may submit more rows (its retries):
        a call that could not be filled waits for it to submit or leave."""
        with self.cond:
            self.callers += 1
        try:
            yield
        finally:
            with self.cond:
                self.callers -= 1
                self.cond.notify_all()

    def answers(self, images: list[Image.Image], prompts: list[str]) -> list[Answer]:
        """The backend's answer for each image under its prompt, in order."""
        mine = [_Row(image, prompt) for image, prompt in zip(images, prompts, strict=True)]
        token = object()
        with self.cond:
            self.pending.extend(mine)
            self.waiting[token] = mine
            try:
                while not all(row.done for row in mine):
                    if self._ready():
                        self._run_one()
                    else:
                        self.cond.wait()
            finally:
                del self.waiting[token]
        for row in mine:
            if row.error is not None:
                raise row.error
        return [row.answer for row in mine]  # type: ignore[misc]

    def _ready(self) -> bool:
        if self.running or not self.pending:
            return False
        # full, or nobody left who could add to it: every caller is blocked on rows not
        # yet generated (one whose rows are all done is about to go on, and may add its
        # retries; callers outside ``caller()`` count only while blocked)
        blocked = sum(not all(row.done for row in rows) for rows in self.waiting.values())
        return len(self.pending) >= self.size.rows or blocked >= self.callers

    def _run_one(self) -> None:
        """Take the oldest rows and generate them, the condition released meanwhile."""
        take = [self.pending.popleft() for _ in range(min(self.size.rows, len(self.pending)))]
        self.running = True
        self.cond.release()
        try:
            answers, error = self._generate(take), None
        except BaseException as e:  # noqa: BLE001 - handed to every caller of the call
            answers, error = [], e
        finally:
            self.cond.acquire()
            self.running = False
            self.cond.notify_all()
        for i, row in enumerate(take):
            row.done, row.error = True, error
            row.answer = answers[i] if error is None else None

    def _generate(self, take: list[_Row]) -> list[Answer]:
        def in_pieces(rows: int) -> list[Answer]:
            out: list[Answer] = []
            for start in range(0, len(take), rows):
                piece = take[start:start + rows]
                out += self.generate([r.image for r in piece], [r.prompt for r in piece])
            return out

        return self.size.run(in_pieces)
