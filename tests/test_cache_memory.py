"""What a recaption actor's caption cache holds in memory (issue 48, "actor memory"): the
embedding tier's cluster reads stay within the partition LRU's bytes, nothing else keeps
what they decoded, and they decode in the calling thread, not in arrow's worker threads
(whose allocator heaps kept the freed pages, growing the actor's RSS with every read;
bench/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairforge.recaption import cache_index
from pairforge.recaption.cache import CACHE_SCHEMA
from pairforge.recaption.cache_index import compact
from pairforge.recaption.cache_lookup import IndexedCaptionCache
from pairforge.shards.storage import OutputDir

ROWS = 3000
DIM = 16
PER_CLUSTER = 50  # ~60 clusters


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.normal(size=(n, DIM)).astype("f4")
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture
def index(tmp_path, monkeypatch) -> tuple[OutputDir, np.ndarray]:
    """A compacted cache of ``ROWS`` entries with vectors, in clusters of ~``PER_CLUSTER``;
    the stored vectors."""
    monkeypatch.setattr(cache_index, "VECTOR_ROWS_PER_CLUSTER", PER_CLUSTER)
    rng = np.random.default_rng(0)
    vectors = _unit(rng, ROWS)
    root = tmp_path / "cache"
    root.mkdir()
    pq.write_table(pa.table({
        "pixel_hash": [f"{i:064x}" for i in range(ROWS)],
        "phash": pa.nulls(ROWS, pa.uint64()),
        "recaption": [f"A dog on the grass, {i}." for i in range(ROWS)],
        "flags": pa.array([[]] * ROWS, pa.list_(pa.string())),
        "embedding": pa.array(vectors.tolist(), pa.list_(pa.float32()))},
        schema=CACHE_SCHEMA), root / "a-0000.parquet")
    folder = OutputDir(str(root))
    marker = compact(folder, {}, 0)
    assert marker["clusters"] >= 40 and marker["counts"]["vectors"] == ROWS
    return folder, vectors


def _queries(vectors: np.ndarray, n: int, seed: int) -> dict[int, list[float]]:
    rng = np.random.default_rng(seed)
    near = vectors[rng.choice(len(vectors), n, replace=False)] + 0.01 * _unit(rng, n)
    return {i: v.tolist() for i, v in enumerate(near)}


def test_cluster_reads_hold_no_more_than_the_lru(index) -> None:
    """Every cluster read, a few kept: the bytes arrow holds for the cache are at most the
    LRU's bound plus the partition being read, and nothing once the cache is dropped."""
    folder, vectors = index
    start = pa.total_allocated_bytes()
    bound = 20_000  # bytes: a few clusters of 50 16-d vectors with their captions
    cache = IndexedCaptionCache(folder, 0, 0.9, max_bytes=bound, probes=10**6)
    found = {}
    for seed in range(4):  # four batches, each probing every cluster
        found.update(cache.lookup_embeddings(_queries(vectors, 16, seed)))
    lru = cache.partitions
    clusters = cache.marker["clusters"]
    assert lru.reads == 4 * clusters  # each batch read each cluster once, none kept between
    assert len(found) == 16 and lru.bytes <= bound
    largest = max(size for _, size in lru.items.values())
    assert 0 < pa.total_allocated_bytes() - start <= bound + largest
    del cache, lru, found
    assert pa.total_allocated_bytes() - start <= 0


_LOOKUPS = """
import json, os, sys
import numpy as np
from pairforge.recaption.cache_lookup import IndexedCaptionCache
from pairforge.shards.storage import OutputDir
threads = lambda: len(os.listdir("/proc/self/task"))
cache = IndexedCaptionCache(OutputDir(sys.argv[1]), 0, 0.9, max_bytes=1, probes=8)
np.ones((64, 64), "f4") @ np.ones((64, 64), "f4")  # numpy's BLAS threads, if it starts any
before = threads()
queries = json.loads(sys.stdin.read())
found = cache.lookup_embeddings({int(i): v for i, v in queries.items()})
print(json.dumps({"before": before, "after": threads(), "found": len(found),
                  "reads": cache.partitions.reads}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_cluster_reads_decode_in_the_calling_thread(index) -> None:
    """A fresh process (arrow's thread pools not yet started) looks up 16 vectors, 8 probes
    each: the clusters are read and decoded without starting a thread."""
    folder, vectors = index
    env = {**os.environ, "OMP_NUM_THREADS": "8"}  # arrow's CPU pool: 8 threads if used
    done = subprocess.run([sys.executable, "-c", _LOOKUPS, folder.url], check=True, env=env,
                          input=json.dumps(_queries(vectors, 16, 7)), capture_output=True,
                          text=True, timeout=120)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["found"] == 16 and seen["reads"] > 8
    assert seen["after"] == seen["before"]
