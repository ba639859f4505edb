"""The caption cache read by lookup (issue 48, item 3): the index a compaction builds from
the log gives the answers of the whole-load cache, folds new parts in, survives a stopped
compaction, and an actor holds a bounded number of its partitions; the claim registry is
partitioned."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairforge.recaption import cache_index
from pairforge.recaption.cache import CACHE_SCHEMA, CaptionCache
from pairforge.recaption.cache_index import INDEX_FOLDER, compact
from pairforge.recaption.cache_lookup import IndexedCaptionCache
from pairforge.shards.storage import OutputDir

CAPTIONS = ["A dog.", "A stop sign.", None, "A cat on grass.", "A red book.", "Two birds."]


@pytest.fixture(autouse=True)
def small_parts(monkeypatch) -> None:
    """Partitions of a few rows, so a small cache has many (and prefixes grow)."""
    monkeypatch.setattr(cache_index, "EXACT_ROWS_PER_PART", 16)
    monkeypatch.setattr(cache_index, "BAND_ROWS_PER_PART", 32)
    monkeypatch.setattr(cache_index, "VECTOR_CHUNK_ROWS", 7)
    monkeypatch.setattr(cache_index, "VECTOR_ROWS_PER_CLUSTER", 16)  # clusters of ~16
    monkeypatch.setattr(cache_index, "LOG_ROWS_PER_TASK", 50)


class Logs:
    """Generated log parts: repeated pixel hashes (last wins), phashes near a few bases,
    abstentions and captions that mention text (never served by the near tiers)."""

    def __init__(self, root: Path, seed: int = 0) -> None:
        self.root = root
        self.folder = OutputDir(str(root))
        self.rng = random.Random(seed)
        self.hashes = [f"{self.rng.getrandbits(256):064x}" for _ in range(60)]
        self.bases = [self.rng.getrandbits(64) for _ in range(20)]

    def vector(self) -> list[float]:
        v = np.random.default_rng(self.rng.getrandbits(32)).normal(size=8).astype("f4")
        return (v / np.linalg.norm(v)).tolist()

    def near(self, flips: int = 2) -> int:
        value = self.rng.choice(self.bases)
        for _ in range(flips):
            value ^= 1 << self.rng.randrange(64)
        return value

    def write(self, name: str, rows: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([{
            "pixel_hash": self.rng.choice(self.hashes),
            "phash": self.near() if self.rng.random() < 0.9 else None,
            "recaption": self.rng.choice(CAPTIONS),
            "flags": ["attribute:x"] if self.rng.random() < 0.3 else [],
            "embedding": self.vector() if self.rng.random() < 0.8 else None,
        } for _ in range(rows)], schema=CACHE_SCHEMA), self.root / name)

    def assert_same_answers(self, distance: int, max_bytes: int = 4000) -> IndexedCaptionCache:
        """Every tier through the index equals the whole load, on hits and misses."""
        old = CaptionCache.load(self.folder, distance, 0.3)
        # every cluster probed: the inverted file answers as the exact search
        new = IndexedCaptionCache(self.folder, distance, 0.3, max_bytes=max_bytes, probes=10**6)
        hashes = self.hashes[:40] + [f"{self.rng.getrandbits(256):064x}" for _ in range(20)]
        phashes = [self.near(1) for _ in hashes]
        vectors = [self.vector() for _ in hashes]
        batch = new.lookup_batch(hashes, phashes)
        embedded = new.lookup_embeddings(dict(enumerate(vectors)))
        tiers = set()
        for i, (h, p, v) in enumerate(zip(hashes, phashes, vectors, strict=True)):
            assert batch.get(i) == old.lookup(h, p), i
            assert embedded.get(i) == old._nearest(v), i
            tiers.update(hit[1] for hit in (batch.get(i), embedded.get(i)) if hit)
        assert "cache" in tiers and "cache_embedding" in tiers
        assert ("cache_phash" in tiers) == bool(distance)
        return new


@pytest.mark.parametrize("distance", [0, 2])
def test_lookup_through_the_index_equals_the_whole_load(tmp_path, distance) -> None:
    logs = Logs(tmp_path / "cache")
    for name in ["b-0003.parquet", "a-0001.parquet", "c-0002.parquet"]:
        logs.write(name, 30)
    logs.assert_same_answers(distance)  # no index yet: the log parts are the tail
    marker = compact(logs.folder, {}, distance)
    assert marker["generation"] == 1 and marker["counts"]["exact"] <= 60
    logs.assert_same_answers(distance)
    logs.write("0-0009.parquet", 25)  # sorts before every folded part
    logs.assert_same_answers(distance)  # index + tail
    for n in range(10):
        logs.write(f"m-{n:04d}.parquet", 40)
    marker = compact(logs.folder, {}, distance)
    assert marker["generation"] == 2 and marker["exact_bits"] >= 2
    assert set(marker["logs"]) == {p.name for p in logs.root.glob("*.parquet")}
    logs.assert_same_answers(distance)
    assert compact(logs.folder, {}, distance) is None  # nothing new


def test_exclusions_serve_exact_pixels_only(tmp_path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    pq.write_table(pa.Table.from_pylist([
        {"pixel_hash": "a" * 64, "phash": 0b1011, "recaption": "A dog.", "flags": [],
         "embedding": [1.0, 0.0]},
        {"pixel_hash": "b" * 64, "phash": 1 << 40, "recaption": "A stop sign.", "flags": [],
         "embedding": [0.0, 1.0]},
        {"pixel_hash": "c" * 64, "phash": 1 << 60, "recaption": None,
         "flags": ["abstained:empty"], "embedding": [0.6, 0.8]},
    ], schema=CACHE_SCHEMA), root / "x-0000.parquet")
    folder = OutputDir(str(root))
    compact(folder, {}, 2)
    cache = IndexedCaptionCache(folder, 2, 0.9)
    assert cache.lookup("x" * 64, 0b1000)[1] == "cache_phash"
    assert cache.lookup("x" * 64, 1 << 40) is None  # mentions text
    assert cache.lookup("x" * 64, 1 << 60) is None  # an abstention
    assert cache.lookup("c" * 64, None)[0].recaption is None  # exact pixels: served
    assert cache.lookup("x" * 64, None, [0.0, 1.0]) is None  # mentions text
    assert cache.lookup("x" * 64, None, [0.6, 0.8]) is None  # an abstention
    assert cache.lookup("x" * 64, None, [0.99, 0.14])[0].recaption == "A dog."


def test_a_second_build_shares_the_cache_folder(tmp_path) -> None:
    """Builds add parts under their own ids; each build's compaction folds in the others'
    parts, whatever their names sort as, and the answers stay the whole load's."""
    logs = Logs(tmp_path / "cache", seed=1)
    for shard in range(3):
        logs.write(f"ffff-{shard:010d}.parquet", 30)  # build 1
    compact(logs.folder, {}, 2)
    for shard in range(3):
        logs.write(f"0000-{shard:010d}.parquet", 30)  # build 2: sorts first
    marker = compact(logs.folder, {}, 2)
    assert marker["generation"] == 2 and len(marker["logs"]) == 6
    logs.assert_same_answers(2)
    # a log part rewritten (a shard made again) rebuilds from every part
    logs.write("0000-0000000001.parquet", 31)
    plan = cache_index.plan_compaction(logs.folder, {}, 2)
    assert plan.previous is None and len(plan.units) == 6
    compact(logs.folder, {}, 2)
    logs.assert_same_answers(2)
    # another phash_distance rebuilds too: its bands differ
    assert cache_index.plan_compaction(logs.folder, {}, 1).previous is None


def test_an_interrupted_compaction_leaves_the_index_as_it_was(tmp_path) -> None:
    logs = Logs(tmp_path / "cache", seed=2)
    for n in range(4):
        logs.write(f"a-{n:04d}.parquet", 30)
    compact(logs.folder, {}, 2)
    for n in range(4):
        logs.write(f"b-{n:04d}.parquet", 30)
    plan = cache_index.with_centroids(
        cache_index.laid_out(cache_index.plan_compaction(logs.folder, {}, 2)))
    for unit in range(len(plan.units)):
        cache_index.scatter(plan, unit)
    cache_index.merge(plan, "exact", cache_index.merge_groups(plan.exact_bits)[0])
    # stopped here: no marker, so readers still see generation 1 (and the new parts as tail)
    index = logs.root / INDEX_FOLDER
    assert (index / plan.work).is_dir() and (index / plan.name).is_dir()
    assert IndexedCaptionCache(logs.folder, 2).marker["generation"] == 1
    logs.assert_same_answers(2)
    marker = compact(logs.folder, {}, 2)  # the next run folds the same parts in again
    assert marker["generation"] == 2 and marker["folder"] != plan.name
    assert not (index / plan.work).exists() and not (index / plan.name).exists()
    logs.assert_same_answers(2)
    logs.write("c-0000.parquet", 30)
    _lapse_pins(logs.folder)  # the readers above are done
    third = compact(logs.folder, {}, 2)
    kept = sorted(p.name for p in index.iterdir() if not p.name.startswith("pin-"))
    assert kept == sorted([f"{marker['folder']}.json", marker["folder"],
                           f"{third['folder']}.json", third["folder"]])


def _lapse_pins(folder: OutputDir) -> None:
    """Every pin as if its holder had stopped renewing it PIN_S ago."""
    for name in folder.glob(f"{INDEX_FOLDER}/pin-*.json"):
        entry = folder.read_json(INDEX_FOLDER, name)
        folder.write_json({**entry, "until": 0.0}, INDEX_FOLDER, name)


def test_a_readers_generation_outlives_later_commits_while_pinned(tmp_path, caplog) -> None:
    """A long build's actor keeps reading its generation however many builds sharing the
    folder commit (its pin keeps it); once the pin has lapsed and a commit removed it,
    the next lookup reads the newest generation instead of failing."""
    logs = Logs(tmp_path / "cache", seed=3)
    logs.write("a-0000.parquet", 40)
    first = compact(logs.folder, {}, 2)
    reader = IndexedCaptionCache(logs.folder, 2, max_bytes=1)  # reads a partition per use
    whole_then = CaptionCache.load(logs.folder, 2)
    for n in range(3):  # three later builds commit: generations 2-4
        logs.write(f"b-{n:04d}.parquet", 20)
        compact(logs.folder, {}, 2)
    index = logs.root / INDEX_FOLDER
    assert (index / first["folder"]).is_dir()
    hashes = logs.hashes
    assert reader.lookup_batch(hashes, [None] * len(hashes)) == {
        i: hit for i, h in enumerate(hashes) if (hit := whole_then.lookup(h, None))}
    _lapse_pins(logs.folder)
    logs.write("c-0000.parquet", 20)
    newest = compact(logs.folder, {}, 2)
    assert not (index / first["folder"]).exists()
    whole_now = CaptionCache.load(logs.folder, 2)
    assert reader.lookup_batch(hashes, [None] * len(hashes)) == {
        i: hit for i, h in enumerate(hashes) if (hit := whole_now.lookup(h, None))}
    assert reader.marker["folder"] == newest["folder"]
    assert f"generation {first['folder']} is gone" in caplog.text


def test_two_compactions_from_one_generation_both_commit(tmp_path) -> None:
    """Two builds compact one folder at once: neither's commit deletes the other's work
    (its pins), both markers stand, and a reader of either answers as the whole log."""
    logs = Logs(tmp_path / "cache", seed=4)
    logs.write("a-0000.parquet", 30)
    compact(logs.folder, {}, 2)
    logs.write("b-0000.parquet", 30)
    slow = cache_index.plan_compaction(logs.folder, {}, 2)
    cache_index.pin_compaction(slow)
    # its tasks are done; its commit comes after the other's
    slow, counts = cache_index.fold(cache_index.laid_out(slow))
    fast = compact(logs.folder, {}, 2)
    index = logs.root / INDEX_FOLDER
    assert (index / slow.work).is_dir() and (index / slow.name).is_dir()
    late = cache_index.commit(slow, counts)
    assert fast["generation"] == late["generation"] == 2 and fast["folder"] != late["folder"]
    markers = sorted(p.name for p in index.glob("gen-*.json"))
    assert markers[-2:] == sorted([f"{fast['folder']}.json", f"{late['folder']}.json"])
    assert not (index / slow.work).exists()
    for marker in (fast, late):
        reader = IndexedCaptionCache(logs.folder, 2)
        reader.marker = marker
        whole = CaptionCache.load(logs.folder, 2)
        hashes = logs.hashes
        assert reader.lookup_batch(hashes, [None] * len(hashes)) == {
            i: hit for i, h in enumerate(hashes) if (hit := whole.lookup(h, None))}


def test_an_actor_holds_a_bounded_number_of_partitions(tmp_path) -> None:
    """The LRU drops the least recently used partitions beyond its bytes; a batch reads
    each partition it touches once."""
    logs = Logs(tmp_path / "cache", seed=3)
    for n in range(12):
        logs.write(f"a-{n:04d}.parquet", 40)
    marker = compact(logs.folder, {}, 2)
    parts = (1 << marker["exact_bits"]) + (1 << marker["bands_bits"])
    cache = logs.assert_same_answers(2, max_bytes=3000)
    lru = cache.partitions
    assert lru.bytes <= lru.max_bytes or len(lru.items) == 1
    assert len(lru.items) < parts
    reads = lru.reads
    cache.lookup_batch(logs.hashes[:1] * 20, [None] * 20)  # one partition, read once
    assert lru.reads - reads <= 1
    whole = IndexedCaptionCache(logs.folder, 2, 0.3, max_bytes=1 << 30)
    whole.lookup_batch(logs.hashes, [logs.near(1) for _ in logs.hashes])
    assert whole.partitions.bytes > lru.max_bytes  # the bound did bind above


def test_the_compaction_as_ray_tasks_equals_the_one_in_process(tmp_path, ray_local) -> None:
    from pairforge.pipeline.caption_index import compact_cache

    logs = Logs(tmp_path / "cache", seed=4)
    for n in range(6):
        logs.write(f"a-{n:04d}.parquet", 30)
    done = compact_cache(logs.folder, {}, 2, retries=0)
    assert done["generation"] == 1 and done["rows"] == 180
    logs.write("0-0000.parquet", 30)
    assert compact_cache(logs.folder, {}, 2, retries=0)["log_parts"] == 1
    assert compact_cache(logs.folder, {}, 2, retries=0) is None
    logs.assert_same_answers(2)


# -- the claim registry -----------------------------------------------------------------


def test_every_hash_has_one_registry_partition() -> None:
    from pairforge.recaption.claims import registry_part

    hashes = [f"{i:064x}" for i in range(2000)]
    parts = registry_part(hashes, 16)
    assert parts.min() >= 0 and parts.max() < 16 and len(set(parts.tolist())) == 16
    assert registry_part(hashes[::-1], 16).tolist() == parts[::-1].tolist()  # stable


def test_partitioned_claims_give_one_claimant_per_image(ray_local) -> None:
    import ray

    from pairforge.recaption.claims import find_registry, start_registry, stop_registry

    actors = start_registry("pairforge-test-claims", parts=4)
    try:
        one = find_registry("pairforge-test-claims")
        two = find_registry("pairforge-test-claims")
        assert len(one.actors) == len(two.actors) == 4
        hashes = [f"{i:064x}" for i in range(40)]
        first = one.claim([(h, f"one-{i}") for i, h in enumerate(hashes)])
        second = two.claim([(h, f"two-{i}") for i, h in enumerate(hashes[::-1])])
        assert first == [f"one-{i}" for i in range(40)]
        assert second == first[::-1]  # the other client finds each claim, whichever actor
        sizes = ray.get([a.claim.remote([]) for a in actors])
        assert sizes == [[]] * 4
        held = [len(ray.get(a.wait.remote([], 0.0))) for a in actors]
        assert held == [0] * 4
        one.publish({h: f"caption {h[-2:]}" for h in hashes[:30]})
        found = two.wait(hashes[:30] + hashes[30:32], 0.2)
        assert found == {h: f"caption {h[-2:]}" for h in hashes[:30]}
        assert not one.lost and not two.lost
    finally:
        stop_registry(actors)
    assert find_registry("pairforge-test-claims") is None


def test_a_registry_has_one_actor_per_rows_per_part() -> None:
    from pairforge.recaption.claims import ROWS_PER_PART, registry_parts

    assert [registry_parts(n) for n in (0, 1, ROWS_PER_PART, ROWS_PER_PART + 1)] == [1, 1, 1, 2]
    assert registry_parts(10**9) == 239  # no actor holds more than its share


def _clustered_log(root: Path, name: str, centres: np.ndarray, per_centre: int,
                   rng: np.random.Generator) -> list[list[float]]:
    """A log part whose vectors lie near ``centres`` (a few degrees off each)."""
    root.mkdir(parents=True, exist_ok=True)
    vectors = []
    for centre in centres:
        for _ in range(per_centre):
            v = centre + rng.normal(scale=0.05, size=centre.shape)
            vectors.append((v / np.linalg.norm(v)).astype("f4").tolist())
    pq.write_table(pa.Table.from_pylist([
        {"pixel_hash": f"{rng.integers(2**62):064x}", "phash": None,
         "recaption": f"A scene numbered {i}.", "flags": [], "embedding": v}
        for i, v in enumerate(vectors)], schema=CACHE_SCHEMA), root / name)
    return vectors


def _directions(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    d = rng.normal(size=(n, dim))
    return d / np.linalg.norm(d, axis=1, keepdims=True)


def test_the_embedding_tier_reads_only_the_clusters_nearest_each_image(tmp_path) -> None:
    """An inverted file: the stored vectors are clustered, and a lookup reads the clusters
    nearest its vector, not every vector; near a stored vector it finds the caption the
    exact search finds."""
    rng = np.random.default_rng(0)
    root = tmp_path / "cache"
    stored = _clustered_log(root, "a-0000.parquet", _directions(12, 16, rng), 24, rng)
    folder = OutputDir(str(root))
    marker = compact(folder, {}, 0)
    assert marker["clusters"] >= 8 and marker["counts"]["vectors"] == len(stored)
    whole = CaptionCache.load(folder, 0, 0.9)
    queries = {i: (np.asarray(stored[i]) + rng.normal(scale=0.01, size=16)).tolist()
               for i in range(0, len(stored), 7)}
    one = IndexedCaptionCache(folder, 0, 0.9, probes=1)
    found = one.lookup_embeddings(queries)
    assert found == {i: hit for i, v in queries.items() if (hit := whole._nearest(v))}
    assert len(found) == len(queries)
    every = IndexedCaptionCache(folder, 0, 0.9, probes=10**6)
    assert every.lookup_embeddings(queries) == found
    # one cluster per query (fewer when queries share one), never the whole store
    fresh = IndexedCaptionCache(folder, 0, 0.9, probes=1)
    fresh.lookup_embeddings({0: queries[0]})
    assert fresh.partitions.reads == 1 < marker["clusters"]


def test_vectors_grown_four_times_get_new_clusters(tmp_path) -> None:
    """A compaction keeps the previous generation's centroids until the vectors have
    grown RECLUSTER_GROWTH times since they were trained; then it rebuilds from every log
    part with new ones, and the answers stay the exact search's."""
    rng = np.random.default_rng(1)
    root = tmp_path / "cache"
    centres = _directions(6, 16, rng)
    _clustered_log(root, "a-0000.parquet", centres, 4, rng)  # 24 vectors
    folder = OutputDir(str(root))
    first = compact(folder, {}, 0)
    _clustered_log(root, "b-0000.parquet", centres, 4, rng)  # 48: the same centroids
    second = compact(folder, {}, 0)
    assert second["clustered_for"] == first["clustered_for"] == 24
    assert second["clusters"] == first["clusters"]
    assert set(second["logs"]) == {"a-0000.parquet", "b-0000.parquet"}
    _clustered_log(root, "c-0000.parquet", _directions(12, 16, rng), 12, rng)  # 192
    third = compact(folder, {}, 0)
    assert third["clustered_for"] == 192 and third["clusters"] > second["clusters"]
    assert third["counts"]["vectors"] == 192
    whole = CaptionCache.load(folder, 0, 0.5)
    reader = IndexedCaptionCache(folder, 0, 0.5, probes=10**6)
    queries = {i: _directions(1, 16, rng)[0].tolist() for i in range(20)}
    assert reader.lookup_embeddings(queries) == {
        i: hit for i, v in queries.items() if (hit := whole._nearest(v))}


def test_a_generation_from_before_the_clusters_is_read_whole_then_rebuilt(tmp_path) -> None:
    """A generation written before the clusters (one vectors.parquet, no clusters in its
    marker) still answers; the next compaction rebuilds it into clusters."""
    logs = Logs(tmp_path / "cache", seed=5)
    for n in range(3):
        logs.write(f"a-{n:04d}.parquet", 30)
    marker = compact(logs.folder, {}, 2)
    index = logs.root / INDEX_FOLDER
    generation = index / marker["folder"]
    tables = [pq.read_table(p) for p in sorted((generation / "vectors").glob("*.parquet"))]
    pq.write_table(pa.concat_tables(tables).sort_by(cache_index.ORDER),
                   generation / "vectors.parquet", row_group_size=7)
    legacy = {k: v for k, v in marker.items() if k not in ("clusters", "clustered_for")}
    (index / f"{marker['folder']}.json").write_text(json.dumps(legacy))
    logs.assert_same_answers(2)  # read whole, chunk by chunk
    assert cache_index.plan_compaction(logs.folder, {}, 2) is None  # nothing new: kept
    logs.write("b-0000.parquet", 30)
    assert cache_index.plan_compaction(logs.folder, {}, 2).previous is None  # a rebuild
    rebuilt = compact(logs.folder, {}, 2)
    assert rebuilt["clusters"] >= 1 and rebuilt["generation"] == 2
    logs.assert_same_answers(2)
