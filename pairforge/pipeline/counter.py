"""The progress counter actor of the stage runners, in a module of its own.

Ray's actor worker imports the module that defines the actor class; this one imports
nothing beyond the standard library, where ``pipeline.progress`` (rich, and pyarrow through
``records``) cost the actor's process ~0.5 s of CPU to start, once per run.
"""

from __future__ import annotations

from collections import Counter


class ProgressCounter:
    """Ray actor body: tasks add per-status counts; the driver reads the running total."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def add(self, delta: dict[str, int]) -> None:
        self.counts.update(delta)

    def total(self) -> dict[str, int]:
        return dict(self.counts)
