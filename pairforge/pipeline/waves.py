"""Waves of Ray tasks over partitioned files: what stage 2 and the semantic pass share.

A phase is one wave: a task per partition (or unit), each reading the files of the waves
before it (``filters/shuffle.py``) and returning only counts, so the driver's memory does
not grow with the rows. :func:`components` is the connected-components loop of
``filters/components.py`` over the edges some wave wrote.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from pairforge.dedup import partitions as parts
from pairforge.dedup.partitions import Work

# Every task but the reading ones is numpy on one core. No task waits on another, so these
# cannot deadlock even a 1-CPU Ray instance.
TASK_CPUS = 1
READ_CPUS = 0.5

T = TypeVar("T")


class Waves:
    """Runs waves of Ray tasks; only their small results come back to the driver."""

    def __init__(self, retries: int):
        self.retries = retries
        self.remotes: dict[str, Any] = {}
        self.seconds: Counter[str] = Counter()  # per phase, for the stats

    def _remote(self, fn: Callable[..., Any], cpus: float, name: str | None) -> tuple[Any, str]:
        import ray

        name = name or fn.__name__
        if name not in self.remotes:
            self.remotes[name] = ray.remote(num_cpus=cpus, max_retries=self.retries)(
                fn).options(name=name)
        return self.remotes[name], name

    def run(self, fn: Callable[..., Any], calls: list[tuple], cpus: float = TASK_CPUS,
            name: str | None = None) -> list[Any]:
        """One wave: ``fn(*args)`` for each of ``calls``, results in call order."""
        import ray

        remote, name = self._remote(fn, cpus, name)
        started = time.perf_counter()
        results = ray.get([remote.remote(*args) for args in calls])
        self.seconds[name] += time.perf_counter() - started
        return results

    def fold(self, fn: Callable[..., Any], calls: list[tuple], combine: Callable[[T, Any], T],
             total: T, cpus: float = TASK_CPUS, name: str | None = None) -> T:
        """One wave whose results are combined as they arrive, so the driver holds one
        result at a time, not one per task."""
        import ray

        remote, name = self._remote(fn, cpus, name)
        started = time.perf_counter()
        pending = [remote.remote(*args) for args in calls]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            total = combine(total, ray.get(done[0]))
        self.seconds[name] += time.perf_counter() - started
        return total


def cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def components(waves: Waves, work: Work, sources: list[tuple[str, int]]) -> tuple[str, int]:
    """Large-star and small-star steps over the edges in ``sources`` (folder, producers)
    until every component is one star; returns the folder of the labels and the distinct
    directed edges the first step read (each undirected edge twice)."""
    step, first_edges = 0, None
    while True:
        results = waves.run(parts.large_star_step,
                            [(work, sources, p, step) for p in range(work.parts)])
        if first_edges is None:
            first_edges = sum(r.edges for r in results)
        if sum(r.not_star for r in results) == 0:
            return f"labels-{step}", first_edges
        waves.run(parts.small_star_step, [(work, p, step) for p in range(work.parts)])
        sources = [(f"large-{step}", work.parts)]
        step += 1
