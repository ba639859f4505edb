"""The work folder of a partitioned dedup run: where each phase's files live.

Stage 2 (``dedup/partitions.py``) and the semantic pass (``dedup/semantic_partitions.py``)
run as phases of tasks; each task writes one file per phase into the run's work folder
(``OUT/dedup/work`` or ``OUT/dedup/semantic-work``), and the next phase's tasks read them.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec

from pairforge.dedup.grids import GridCheck


@dataclass(frozen=True)
class Work:
    """Where a run's intermediate files live and how they are partitioned."""

    root: str  # URL of the work folder (OUT/dedup/work)
    storage_options: dict[str, Any]
    parts: int  # partitions of rows, keys, exact hashes, values and links
    max_distance: int
    check: GridCheck = GridCheck()  # dedup/decide.colour_groups; whether mirrors count
    perceptual: bool = True  # False: no row's hashes enter the near join (exact only)
    # An append (pipeline/dedup_stage.py): this build's label in its own index, whose
    # rows are read back as index rows (they win, as shipped rows) with no source, so
    # that a new row dropped for one is a duplicate within this build
    own_source: str | None = None
    # (duplicates, index) URLs of that finished run: a raw shard that --retry-failed
    # rewrote since is read again, less the rows those files hold decisions for
    earlier: tuple[str, str] | None = None

    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.root, **self.storage_options)[0]

    def path(self, *names: str) -> str:
        base = fsspec.core.url_to_fs(self.root, **self.storage_options)[1]
        return posixpath.join(base, *names)

    def files(self, folder: str, producers: int) -> list[str]:
        """The file of each producer task of a phase (every producer writes one)."""
        return [self.path(folder, f"{i:06d}.parquet") for i in range(producers)]

    def file(self, folder: str, producer: int) -> str:
        return self.path(folder, f"{producer:06d}.parquet")

    def expand(self, sources: list[tuple[str, int]]) -> list[str]:
        """The files of several phases, each given as (folder, producers)."""
        return [path for folder, producers in sources for path in self.files(folder, producers)]


@dataclass(frozen=True)
class InputFile:
    number: int  # its place among all inputs: raw shards first, then index files
    url: str
    index: bool  # an index file of an earlier build
    rewritten: bool = False  # a raw shard rewritten since the finished run read it
