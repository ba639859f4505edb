"""Connected components over the edges a wave wrote: the large-star and small-star loop of
``dedup/components.py``, as waves of Ray tasks (``executors.Waves``), what stage 2 and the
semantic pass share. A phase is one wave: a task per partition, each reading the files of
the waves before it (``dedup/shuffle.py``) and returning only counts, so the driver's
memory does not grow with the rows.
"""

from __future__ import annotations

from pairforge.dedup import partitions as parts
from pairforge.dedup.work import Work
from pairforge.pipeline.executors import Waves


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
