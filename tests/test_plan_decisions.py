"""Stage 3's plan counts each shard's duplicates without holding their keys, and each
shard's task reads its own key range of the sorted dedup tables (pipeline/plan.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.dedup.decide import DUPLICATES_SCHEMA
from pairforge.pipeline.plan import Decisions
from pairforge.records import make_key


def _table(keys: list[str], kind: str) -> pa.Table:
    return pa.table({"key": keys, "kind": [kind] * len(keys), "cluster_id": keys,
                     "kept_key": [f"k{k}" for k in keys], "kept_source": [None] * len(keys),
                     "distance": [0] * len(keys)}, schema=DUPLICATES_SCHEMA)


def test_counts_and_one_shards_range(tmp_path):
    # shards 3, 10000 and 100000: shard 100000's keys sort inside shard 10000's range
    keys = sorted([make_key(3, i) for i in range(5)] + [make_key(10_000, i) for i in (0, 7)]
                  + [make_key(100_000, i) for i in (0, 1, 2)])
    assert make_key(10_000, 0) < make_key(100_000, 2) < make_key(10_000, 9_999)
    hashed = tmp_path / "duplicates.parquet"
    pq.write_table(_table(keys, "duplicate_near"), hashed, row_group_size=3)
    semantic = tmp_path / "semantic.parquet"
    pq.write_table(_table([make_key(3, 4), make_key(3, 9)], "duplicate_semantic"), semantic)
    found = Decisions((str(hashed), str(semantic)))
    assert found.counts() == {3: 7, 10_000: 2, 100_000: 3}
    assert found.of_shard(10_000) == {make_key(10_000, 0): ("duplicate_near", "k100000000"),
                                      make_key(10_000, 7): ("duplicate_near", "k100000007")}
    assert sorted(found.of_shard(100_000)) == [make_key(100_000, i) for i in (0, 1, 2)]
    # the later table's decision wins for a key in both (as the writer applies them)
    assert found.of_shard(3)[make_key(3, 4)] == ("duplicate_semantic", "k000030004")
    assert len(found.of_shard(3)) == 6 and found.of_shard(4) == {}
    assert Decisions(()).counts() == {} and Decisions(()).of_shard(3) == {}


def test_merge_sorted_streams_two_sorted_tables_into_one():
    import random

    from pairforge.dedup.key_ranges import merge_sorted

    rng = random.Random(3)
    for _ in range(50):
        keys = sorted({f"{rng.randrange(10_000):09d}" for _ in range(rng.randrange(60))})
        earlier = sorted(k for k in keys if rng.random() < 0.6)
        new = sorted(set(keys) - set(earlier))

        def chunks(values: list[str]) -> list[pa.Table]:
            cuts = sorted(rng.sample(range(len(values) + 1), min(3, len(values) + 1)))
            bounds = [0, *cuts, len(values)]
            return [_table(values[a:b], "duplicate_near")
                    for a, b in zip(bounds, bounds[1:], strict=False)]

        merged = list(merge_sorted(iter(chunks(earlier)), iter(chunks(new))))
        assert [k for t in merged for k in t["key"].to_pylist()] == keys


def test_read_key_range_equals_pyarrows_filtered_read(tmp_path):
    """Row groups pruned by statistics, several ranges, one source: the same rows, in the
    same order, as pq.read_table with the same filters (which went through pyarrow.dataset,
    whose threads aborted processes at exit now and then)."""
    from pairforge.tables import read_key_range

    keys = [f"{i:06d}" for i in range(0, 3000, 3)]
    table = pa.table({"key": keys, "source": ["a" if i % 2 else "b" for i in range(len(keys))],
                      "value": list(range(len(keys)))})
    path = tmp_path / "sorted.parquet"
    pq.write_table(table, path, row_group_size=100)
    ranges = [("000010", "000300"), ("001500", "001503"), ("002990", "009999"),
              ("000400", "000399")]
    for source in (None, "a"):
        extra = [("source", "==", source)] if source else []
        expected = pq.read_table(path, columns=["key", "value"], filters=[
            [("key", ">=", low), ("key", "<=", high), *extra] for low, high in ranges])
        found = read_key_range(str(path), {}, ["key", "value"], ranges, source)
        assert found.equals(expected) and found.num_rows > 0
    assert read_key_range(str(path), {}, ["key"], [("x", "y")]).num_rows == 0
