"""Fixed batch shapes for model forwards: a row's result must not depend on its neighbours.

A model's float results depend on the shape of the batch a row rides in: the matrix
kernels choose their blocking, and how they split rows among threads, by the number of
rows. CLIP ViT-B/32 on this project's CPU gives a row's image embedding bit for bit at 4,
8, 16 or 32 rows, wherever the row sits and whatever rides beside it, but 2.6e-6 off at 1
to 3 rows, and at 5, 7 or 9 rows with two threads. Stage 3 meets rows in batches that Ray
Data cuts where its blocks end: a resume, an append or another pool size cuts them
elsewhere, and a score at a threshold, or at the edge of a ``top_fraction``, could flip
between two builds of the same data. So every model forward runs on exactly ``rows`` rows
(the step's ``batch_size``): the batch in chunks of that size, the last one padded with
copies of its last row, whose outputs are dropped. The padding costs at most one partial
chunk per Ray Data batch. A row's bytes then depend on ``batch_size``, never on how the
build was cut (tests/test_batch_invariance.py).

**Out of memory.** ``FixedForward`` holds an actor's forward size: a forward that runs
out of device memory is run again, the whole batch, at half the size, and the actor keeps
the smaller size from then on (a warning says so), so no row is lost and every row of a
call still rides one shape. ``batch_size: auto`` starts at ``config.AUTO_BATCH_ROWS`` and
lets this find the size that fits. Rows computed after a halving may differ from a run
that never halved in their last bits: the shape is the card's, not the build's.

Ground floor: torch is imported by the callers, which pass tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def fixed_chunks(batch: torch.Tensor, rows: int) -> list[tuple[torch.Tensor, int]]:
    """``batch`` cut into chunks of exactly ``rows`` rows, each with how many are real."""
    import torch

    chunks = []
    for start in range(0, batch.shape[0], rows):
        chunk = batch[start:start + rows]
        real = chunk.shape[0]
        if real < rows:
            chunk = torch.cat([chunk, chunk[-1:].expand(rows - real, *chunk.shape[1:])])
        chunks.append((chunk, real))
    return chunks


def run_fixed(fn: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor,
              rows: int) -> torch.Tensor:
    """``fn(batch)`` computed on chunks of exactly ``rows`` rows (``fn`` maps a batch to
    one output row per input row); ``fn(batch)`` itself for an empty batch."""
    import torch

    if batch.shape[0] == 0:
        return fn(batch)
    return torch.cat([fn(chunk)[:real] for chunk, real in fixed_chunks(batch, rows)])


class Halving:
    """An actor's rows per model call, halved on out-of-memory (see above): ``run(fn)``
    calls ``fn(rows)`` and, when it runs out of device memory, calls it again at half the
    rows, the actor keeping the smaller size from then on; at one row the error is raised.
    ``fn`` must redo the whole call (every row of it), so no row is lost."""

    def __init__(self, rows: int, what: str) -> None:
        self.rows = rows
        self.what = what  # the step, for the warning

    def run(self, fn: Callable[[int], T]) -> T:
        import torch

        while True:
            try:
                return fn(self.rows)
            except torch.OutOfMemoryError:
                if self.rows == 1:
                    raise
                self.rows //= 2
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                logging.getLogger(__name__).warning(
                    "%s: out of memory; calls of %d rows from now on", self.what, self.rows)


class FixedForward(Halving):
    """``run_fixed`` at an actor's forward size, halved on out-of-memory (see above)."""

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor],
                 batch: torch.Tensor) -> torch.Tensor:
        return self.run(lambda rows: run_fixed(fn, batch, rows))
