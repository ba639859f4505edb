"""What each dedup is computed from: its declared inputs, which its staleness digest covers.

Stage 2 reads the raw shards' hash columns and the index files of earlier builds
(:class:`Inputs`); the semantic pass reads the scoring pass's embedding files
(:func:`embedding_files`). Files are declared by name and size, so a new or rewritten
file makes a finished run stale; ``pipeline/settings.inputs_digest`` digests them with
the stage's config section.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec

from pairforge.config import DedupConfig
from pairforge.shards.raw import shard_name
from pairforge.shards.storage import EMBEDDINGS_FOLDER, OutputDir


def raw_files(raw_dir: str, storage_options: dict[str, Any]) -> list[str]:
    """URLs of the raw shards' parquet files, sorted."""
    fs, root = fsspec.core.url_to_fs(raw_dir, **storage_options)
    fs.invalidate_cache()  # object stores: the shards were written by other processes
    files = sorted(fs.unstrip_protocol(p) for p in fs.glob(posixpath.join(root, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"no raw shard parquet files in {raw_dir}")
    return files


def _described(paths: list[str], storage_options: dict[str, Any]) -> list[tuple[str, int]]:
    out = []
    for path in paths:
        fs, stripped = fsspec.core.url_to_fs(path, **storage_options)
        out.append((posixpath.basename(stripped), int(fs.info(stripped)["size"])))
    return out


@dataclass(frozen=True)
class Inputs:
    """What a dedup is computed from: its config and the raw/index files (name and size),
    so new or rewritten raw shards or another config make a finished run stale."""

    files: list[str]
    indexes: list[str]
    raw: list[tuple[str, int]]
    index: list[tuple[str, int]]
    config: dict[str, Any]

    @classmethod
    def describe(cls, files: list[str], indexes: list[str], cfg: DedupConfig,
                 storage_options: dict[str, Any]) -> Inputs:
        # semantic dedup is stage 3's pass: its settings do not make this stage stale
        return cls(files, indexes, _described(files, storage_options),
                   _described(indexes, storage_options),
                   cfg.model_dump(mode="json", exclude={"semantic"}))

    def declared(self) -> dict[str, Any]:
        """Every input file: what the run's digest covers besides the config."""
        return {"raw": self.raw, "index": self.index}

    def settings(self) -> dict[str, Any]:
        """The index files alone: their digest with the config is recorded in the stats
        (covered.parquet has each raw shard) so that a later run can tell an append from
        any other change."""
        return {"index": self.index}


def embedding_files(out: OutputDir, shard_ids: list[int]) -> list[tuple[str, int]]:
    """The semantic pass's inputs: each shard's embedding file (name, size) that exists."""
    files = []
    for shard_id in shard_ids:
        name = f"{shard_name(shard_id)}.npy"
        if out.exists(EMBEDDINGS_FOLDER, name):
            files.append((name, int(out.fs.info(out.path(EMBEDDINGS_FOLDER, name))["size"])))
    return files
