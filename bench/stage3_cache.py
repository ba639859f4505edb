"""The recaption actor's memory with a caption cache of 10^5 and 10^7 entries (issue 48,
item 3); ``bench/stage3.py --cache-entries`` runs it.

For each size, log parts of random entries (64-hex pixel hashes, random perceptual hashes,
short captions from a pool, no flags) are written in parts of ``CHUNK`` rows, as the
writers of a build of shards that size would. Stage 3's compaction (the Ray tasks of
pipeline/caption_index.py on a 2-CPU local Ray) folds them into an index: its wall time is
indicative (the host's 2 cores are shared). Then a fresh process imports the recaption
step's module, builds the step's cache object as its ``__init__`` does
(``IndexedCaptionCache`` with the default partition bound, ``phash_distance`` 2) and
answers ``BATCHES`` batches of ``BATCH`` rows: a quarter exact hits, a quarter
perceptual-hash hits (one bit flipped), half misses. Its peak RSS (getrusage) is
``recaption_actor_peak_rss_mib``. The embedding tier (``bench/stage3.py --cache-embedding
[ENTRIES ...]``, 10^5 by default) is measured over ``EMBEDDING_BATCHES`` batches, a quarter
of each batch's rows near a stored vector: the index clusters the vectors (an inverted
file) and each lookup reads the ``embedding_probes`` clusters nearest its vector; the
vectors are random, so the clusters carry no structure and a batch's probes spread over
many of them (real image vectors cluster). ``--cache-before`` measures the whole-load
cache (``CaptionCache.load``) the same way, up to 10^6 entries.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import json_from_child

CHUNK = 100_000  # entries per log part
QUERIES = 8_000  # known entries sampled for the hits
BATCHES = 2_000
BATCH = 16
EMBEDDING_BATCHES = 200
DISTANCE = 2
DIM = 256  # the embedding tier's vectors (SigLIP-size vectors are 768-1152)
THRESHOLD = 0.9

_WORDS = ("dog", "cat", "bird", "horse", "cow", "boat", "car", "bus", "train", "tree",
          "flower", "bench", "kite", "plate", "cup", "bowl", "chair", "bed", "beach", "field",
          "road", "river", "hill", "street", "kitchen", "garden")

_ACTOR = """
import json, os, resource, sys, time
import numpy as np, pyarrow.parquet as pq
import pairforge.recaption.step  # what a recaption actor imports
from pairforge.recaption.cache import CaptionCache
from pairforge.recaption.cache_lookup import IndexedCaptionCache
from pairforge.shards.storage import OutputDir
folder, mode, threshold, queries, distance, batch = sys.argv[1:7]
threshold = None if threshold == "none" else float(threshold)
distance, batch = int(distance), int(batch)
started = time.perf_counter()
if mode == "index":
    cache = IndexedCaptionCache(OutputDir(folder), distance, threshold)
else:
    cache = CaptionCache.load(OutputDir(folder), distance, threshold)
opened = time.perf_counter() - started
q = pq.read_table(queries).to_pydict()
tiers = {}
started = time.perf_counter()
for b in range(0, len(q["pixel_hash"]), batch):
    hashes, phashes = q["pixel_hash"][b:b + batch], q["phash"][b:b + batch]
    vectors = q["embedding"][b:b + batch] if threshold else [None] * len(hashes)
    if mode == "index":
        found = cache.lookup_batch(hashes, phashes)
        found.update(cache.lookup_embeddings({i: v for i, v in enumerate(vectors)
                                              if i not in found and v is not None}))
    else:
        found = {i: h for i, h in enumerate(cache.lookup(a, p, v) for a, p, v
                                            in zip(hashes, phashes, vectors)) if h}
    for hit in found.values():
        tiers[hit[1]] = tiers.get(hit[1], 0) + 1
seconds = time.perf_counter() - started
usage = resource.getrusage(resource.RUSAGE_SELF)
held = getattr(cache, "partitions", None)
print(json.dumps({"peak_rss_mib": usage.ru_maxrss / 1024, "open_s": opened,
                  "lookup_ms_per_batch": 1000 * seconds / (len(q["pixel_hash"]) / batch),
                  "hits": tiers, "partitions_held_mib": held and held.bytes / 2**20,
                  "partition_reads": held and held.reads}), flush=True)
os._exit(0)  # measured; a C++ abort at interpreter exit was seen once (issue 48, clean exit)
"""


def _captions(rng: np.random.Generator) -> pa.Array:
    pool = {f"A {a} and a {b} by the {c}." for a, b, c in rng.choice(_WORDS, (3000, 3))}
    return pa.array(sorted(pool), pa.string())


def _vectors(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM), dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _list_array(vectors: np.ndarray) -> pa.Array:
    offsets = pa.array(np.arange(len(vectors) + 1, dtype=np.int32) * vectors.shape[1])
    return pa.ListArray.from_arrays(offsets, pa.array(vectors.ravel()))


def write_log(folder: Path, entries: int, embedding: bool, seed: int = 0) -> pa.Table:
    """The log parts of ``entries`` random entries; returns a sample of them."""
    from pairforge.recaption.cache import CACHE_SCHEMA

    rng = np.random.default_rng(seed)
    captions = _captions(rng)
    folder.mkdir(parents=True, exist_ok=True)
    parts = math.ceil(entries / CHUNK)
    samples = []
    for part in range(parts):
        n = min(CHUNK, entries - part * CHUNK)
        raw = rng.bytes(32 * n).hex()
        vectors = _vectors(rng, n) if embedding else None
        table = pa.table({
            "pixel_hash": pa.array([raw[i * 64:(i + 1) * 64] for i in range(n)]),
            "phash": pa.array(rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)),
            "recaption": captions.take(rng.integers(0, len(captions), n)),
            "flags": pa.array([[]] * n, pa.list_(pa.string())),
            "embedding": (_list_array(vectors) if embedding
                          else pa.nulls(n, pa.list_(pa.float32())))}, schema=CACHE_SCHEMA)
        pq.write_table(table, folder / f"bench00000-{part:010d}.parquet")
        samples.append(table.take(rng.choice(n, min(n, math.ceil(QUERIES / parts)),
                                             replace=False)))
    return pa.concat_tables(samples)


def write_queries(path: Path, sample: pa.Table, batches: int = BATCHES, seed: int = 1) -> None:
    """Batches of a quarter exact hits, a quarter phash hits (one bit off), half misses
    of both; with vectors, half of those misses carry a vector near a stored one."""
    rng = np.random.default_rng(seed)
    rows = batches * BATCH
    kind = np.tile(np.repeat([0, 1, 2, 3], BATCH // 4), batches)
    pick = rng.integers(0, len(sample), rows)
    known_hash = np.asarray(sample["pixel_hash"].to_pylist(), dtype=object)[pick]
    known_phash = sample["phash"].to_numpy()[pick]
    fresh_hash = rng.bytes(32 * rows).hex()
    fresh = np.array([fresh_hash[i * 64:(i + 1) * 64] for i in range(rows)], dtype=object)
    flipped = known_phash ^ (np.uint64(1) << rng.integers(0, 64, rows).astype(np.uint64))
    random_phash = rng.integers(0, 2**64, rows, dtype=np.uint64, endpoint=False)
    hashes = np.where(kind == 0, known_hash, fresh)
    phashes = np.where(kind == 1, flipped, random_phash)
    table = {"pixel_hash": pa.array(hashes.tolist(), pa.string()), "phash": pa.array(phashes)}
    if sample["embedding"].null_count == 0:
        stored = np.stack([np.asarray(v, np.float32) for v in
                           sample["embedding"].take(pick).to_pylist()])
        near = stored + 0.05 * _vectors(rng, rows)
        near /= np.linalg.norm(near, axis=1, keepdims=True)
        table["embedding"] = _list_array(np.where((kind == 2)[:, None], near,
                                                  _vectors(rng, rows)))
    else:
        table["embedding"] = pa.nulls(rows, pa.list_(pa.float32()))
    pq.write_table(pa.table(table), path)


def compact_timed(folder: Path) -> dict[str, Any]:
    """Stage 3's compaction of ``folder`` on a local 2-CPU Ray."""
    import ray

    from pairforge.config import RayConfig
    from pairforge.pipeline.caption_index import compact_cache
    from pairforge.pipeline.ray_runtime import init_ray
    from pairforge.shards.storage import OutputDir

    init_ray(RayConfig(num_cpus=2))
    try:
        started = time.perf_counter()
        done = compact_cache(OutputDir(str(folder)), {}, DISTANCE, retries=0)
        return {"compaction_s": round(time.perf_counter() - started, 1), **done}
    finally:
        ray.shutdown()


def actor(folder: Path, queries: Path, mode: str, threshold: float | None) -> dict[str, Any]:
    return json_from_child(["-c", _ACTOR, str(folder), mode,
                            "none" if threshold is None else str(threshold), str(queries),
                            str(DISTANCE), str(BATCH)],
                           "the recaption actor's cache")


def measure(entries: int, work: Path, embedding: bool = False,
            before: bool = False) -> dict[str, Any]:
    """One size; with ``embedding``, ``EMBEDDING_BATCHES`` batches (each scans every
    stored vector)."""
    folder = work / f"cache{entries}{'-emb' if embedding else ''}"
    shutil.rmtree(folder, ignore_errors=True)
    started = time.time()
    sample = write_log(folder, entries, embedding)
    log_bytes = sum(p.stat().st_size for p in folder.glob("*.parquet"))
    print(f"{entries:,} cache entries: log written in {time.time() - started:.0f} s "
          f"({log_bytes / 2**20:.0f} MiB)", flush=True)
    queries = work / f"queries{entries}.parquet"
    write_queries(queries, sample, EMBEDDING_BATCHES if embedding else BATCHES)
    threshold = THRESHOLD if embedding else None
    result = {"entries": entries, "embedding": embedding,
              "log_mib": round(log_bytes / 2**20, 1), **compact_timed(folder)}
    result["actor"] = actor(folder, queries, "index", threshold)
    if before:
        result["before"] = actor(folder, queries, "load", threshold)
    print(json.dumps(result), flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return result
