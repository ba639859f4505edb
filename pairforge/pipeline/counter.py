"""The progress counter actor of the stage runners, in a module of its own.

Ray's actor worker imports the module that defines the actor class; this one imports
nothing beyond the standard library, where ``pipeline.progress`` (rich, and pyarrow through
``records``) cost the actor's process ~0.5 s of CPU to start, once per run.
"""

from __future__ import annotations

from collections import Counter


class ProgressCounter:
    """Ray actor body: tasks add per-status counts and learn, in reply, how many task slots
    each may use; the driver reads the running total and sets the slots."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.slots = 1

    def add(self, delta: dict[str, int]) -> int:
        self.counts.update(delta)
        return self.slots

    def total(self) -> dict[str, int]:
        return dict(self.counts)

    def share(self, slots: int) -> None:
        self.slots = slots
