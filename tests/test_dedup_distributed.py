"""Distributed stage 2 (pipeline/dedup_stage.py over filters/dedup_parts.py) against the
single-process decision (filters/dedup.find_duplicates, the oracle): the same
duplicates.parquet rows, the same stats counts and the same next index, on generated sets
with planted duplicates of every kind, over many partitions; components, shuffle files
and a worker killed in the middle of the stage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cluster_utils import LocalCluster, family
from dedup_sets import generated_rows, oracle, read_index_folder, write_raw
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from pairforge.config import DedupConfig, RayConfig
from pairforge.dedup.components import EDGE_SCHEMA, LABEL_SCHEMA, write_edges
from pairforge.dedup.shuffle import mix64, read_part, string_hash, write_parts
from pairforge.records import Status

RAY = RayConfig(num_cpus=2)
T = DedupConfig().max_distance

# the stats both compute (the stage adds its own: files, statuses, digest, seconds)
DECISION_STATS = ["ok_rows", "index_rows", "duplicates", *(s.value for s in (
    Status.DUPLICATE_EXACT, Status.DUPLICATE_NEAR, Status.DUPLICATE_MIRROR,
    Status.DUPLICATE_CROP)), "dropped_for_index", "clusters", "colour_splits", "kept",
    "degenerate_hashes",
    "missing_phash", "distinct_phashes", "dense_phashes", "near_pairs", "max_distance",
    "band_plan"]


@pytest.fixture
def small_parts(monkeypatch):
    """Partitions of a few dozen rows: every phase runs as many tasks."""
    from pairforge.pipeline import dedup_stage

    monkeypatch.setattr(dedup_stage, "ROWS_PER_PART", 300)
    monkeypatch.setattr(dedup_stage, "ROWS_PER_SCATTER", 700)
    monkeypatch.setattr(dedup_stage, "VALUES_PER_BAND_TASK", 2000)
    monkeypatch.setattr(dedup_stage, "INDEX_ROWS_PER_PART", 500)


def run_stage(raw: Path, out: Path, cfg: DedupConfig, **kwargs) -> dict:
    from pairforge.pipeline.dedup_stage import run_dedup

    return run_dedup(str(raw), str(out), cfg, RAY, force=True, **kwargs)


def assert_same(raw: Path, out: Path, stats: dict, indexes: list[Path], source: str,
                max_distance: int = T, perceptual: bool = True) -> dict:
    """The stage's outputs equal the oracle's over the same files; returns its stats."""
    expected, expected_stats, expected_index = oracle(raw, indexes, max_distance, source,
                                                      perceptual)
    found = pq.read_table(out / "duplicates.parquet")
    assert found.equals(expected)
    assert {k: stats[k] for k in DECISION_STATS} == expected_stats
    if (out / "index.parquet").exists():
        assert read_index_folder(out / "index.parquet").sort_by(
            [("source", "ascending"), ("key", "ascending")]).equals(expected_index)
    assert not (out / "work").exists()
    return expected_stats


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_generated_sets_decide_as_the_single_process(seed, tmp_path, ray_local,
                                                     small_parts):
    rows = generated_rows(seed, families=120, chain_rows=1100 if seed == 1 else 0)
    write_raw(tmp_path / "raw", rows, shards=7)
    stats = run_stage(tmp_path / "raw", tmp_path / "out", DedupConfig())
    expected = assert_same(tmp_path / "raw", tmp_path / "out", stats, [], str(tmp_path))
    # every kind of evidence and every special case is really there
    kinds = [expected[s.value] for s in (Status.DUPLICATE_EXACT, Status.DUPLICATE_NEAR,
                                         Status.DUPLICATE_MIRROR, Status.DUPLICATE_CROP)]
    assert min(kinds) > 0, expected
    assert expected["dense_phashes"] > 0 and expected["degenerate_hashes"] > 0
    assert expected["missing_phash"] > 0 and expected["band_plan"] != "all pairs"
    parts = len(list((tmp_path / "out" / "index.parquet").iterdir()))
    assert parts > 1  # the index really is in hash-prefix parts


def test_chained_rows_of_a_long_chain_are_labelled_from_its_first_members(
        tmp_path, ray_local, small_parts):
    """A component of more than 1,000 rows, mostly linked to its survivor through
    others: their kind comes from the component's first 1,001 rows (in input order)."""
    rows = generated_rows(9, families=5, chain_rows=1500)
    write_raw(tmp_path / "raw", rows, shards=3)
    stats = run_stage(tmp_path / "raw", tmp_path / "out", DedupConfig(write_index=False))
    assert_same(tmp_path / "raw", tmp_path / "out", stats, [], str(tmp_path))
    assert stats["duplicates"] > 1000


def test_an_index_of_parts_and_an_older_index_decide_as_the_single_process(
        tmp_path, ray_local, small_parts):
    """Build 1 writes its index as hash-prefix parts; build 2 (other rows, some of them
    copies of build 1's) reads it, and also an index without pixel hashes of this
    version: the same decisions and the same next index as the single process."""
    rows = generated_rows(4, families=150)
    write_raw(tmp_path / "raw1", rows[: len(rows) // 2], shards=4)
    stats1 = run_stage(tmp_path / "raw1", tmp_path / "b1" / "dedup", DedupConfig())
    assert_same(tmp_path / "raw1", tmp_path / "b1" / "dedup", stats1, [],
                str(tmp_path / "b1"))
    index1 = tmp_path / "b1" / "dedup" / "index.parquet"
    legacy = tmp_path / "legacy.parquet"
    first = sorted(index1.glob("*.parquet"))[0]
    pq.write_table(pq.read_table(first).replace_schema_metadata(), legacy)
    write_raw(tmp_path / "raw2", rows[len(rows) // 3:], shards=5)
    cfg = DedupConfig(index=[str(index1), str(legacy)])
    stats2 = run_stage(tmp_path / "raw2", tmp_path / "b2" / "dedup", cfg)
    expected = assert_same(tmp_path / "raw2", tmp_path / "b2" / "dedup", stats2,
                           [index1, legacy], str(tmp_path / "b2"))
    assert expected["dropped_for_index"] > 0
    assert stats2["index_rows_without_pixel_hash"] == pq.read_metadata(legacy).num_rows


def test_without_near_search_and_with_one_partition(tmp_path, ray_local):
    rows = generated_rows(5, families=40)
    write_raw(tmp_path / "raw", rows, shards=2)
    for distance in (0, T):
        out = tmp_path / f"out{distance}"
        stats = run_stage(tmp_path / "raw", out, DedupConfig(max_distance=distance))
        assert_same(tmp_path / "raw", out, stats, [], str(tmp_path), distance)


def test_exact_only_drops_exact_copies_and_nothing_else(tmp_path, ray_local):
    """dedup.perceptual false: near, mirrored and cropped copies all stay; rows with the
    same pixels or bytes still go, as in the single process."""
    rows = generated_rows(5, families=40)
    write_raw(tmp_path / "raw", rows, shards=2)
    near = run_stage(tmp_path / "raw", tmp_path / "near", DedupConfig())
    exact = run_stage(tmp_path / "raw", tmp_path / "exact", DedupConfig(perceptual=False))
    assert_same(tmp_path / "raw", tmp_path / "exact", exact, [], str(tmp_path),
                perceptual=False)
    kinds = pq.read_table(tmp_path / "exact" / "duplicates.parquet")["kind"].to_pylist()
    assert kinds and set(kinds) == {Status.DUPLICATE_EXACT.value}
    assert exact["near_pairs"] == 0 and exact["duplicate_near"] == 0
    assert exact[Status.DUPLICATE_EXACT.value] == near[Status.DUPLICATE_EXACT.value]
    assert exact["duplicates"] < near["duplicates"]


# ------------------------------------------------------------------------ the machinery


def test_components_match_scipy_on_random_graphs(tmp_path):
    """Large-star/small-star over partitioned edge files finds scipy's components."""
    import fsspec

    from pairforge.dedup.components import large_star, small_star

    fs = fsspec.filesystem("file")
    rng = np.random.default_rng(0)
    for trial in range(6):
        nodes = rng.choice(10**12, 400, replace=False).astype(np.int64)
        edges = rng.integers(0, len(nodes), (int(rng.integers(50, 500)), 2))
        if trial == 0:  # a path: the worst case for label propagation
            edges = np.stack([np.arange(399), np.arange(1, 400)], axis=1)
        parts, folder = int(rng.integers(1, 5)), tmp_path / f"g{trial}"
        write_edges(fs, str(folder / "e" / "0.parquet"), nodes[edges[:, 0]],
                    nodes[edges[:, 1]], parts)
        inputs, step = [str(folder / "e" / "0.parquet")], 0
        while True:
            out = [str(folder / f"s{step}" / f"{p}.parquet") for p in range(parts)]
            labels = [str(folder / f"l{step}" / f"{p}.parquet") for p in range(parts)]
            results = [large_star(fs, inputs, p, out[p], labels[p], parts)
                       for p in range(parts)]
            if not sum(r.not_star for r in results):
                break
            inputs = [str(folder / f"b{step}" / f"{p}.parquet") for p in range(parts)]
            for p in range(parts):
                small_star(fs, out, p, inputs[p], parts)
            step += 1
        found = pa.concat_tables([pq.read_table(f) for f in labels]).cast(LABEL_SCHEMA)
        graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])),
                           shape=(len(nodes), len(nodes)))
        _, expected = connected_components(graph, directed=False)
        touched = np.unique(edges[edges[:, 0] != edges[:, 1]])  # self-links say nothing
        label_of = dict(zip(found["node"].to_pylist(), found["label"].to_pylist(),
                            strict=True))
        assert set(label_of) == set(nodes[touched].tolist())
        for component in np.unique(expected[touched]):
            members = nodes[touched[expected[touched] == component]]
            assert {label_of[m] for m in members.tolist()} == {int(members.min())}


def test_shuffle_files_and_stable_hashes(tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    strings = pa.array(["", "a", "ab", "ba", None, "000010005", "x" * 300])
    hashes = string_hash(strings)
    assert len(set(hashes.tolist())) == 6  # None hashes as ""
    assert hashes[4] == hashes[0]
    # the same on every run, every process: fixed values
    assert string_hash(pa.array(["000010005"]))[0] == string_hash(
        pa.chunked_array([["x"], ["000010005"]]))[1]
    assert mix64(np.array([0, 1], np.uint64)).tolist() == [0, 0x5692161D100B05E5]
    assert string_hash(pa.array(["000010005"]))[0] == 3466270407956531891
    table = pa.table({"u": np.arange(10, dtype=np.int64), "v": np.arange(10, dtype=np.int64)},
                     schema=EDGE_SCHEMA)
    parts = np.array([3, 0, 3, 3, 1, 0, 3, 3, 0, 1])
    write_parts(fs, str(tmp_path / "a.parquet"), table, parts)
    write_parts(fs, str(tmp_path / "b.parquet"), table.slice(0, 0), parts[:0])
    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    for p in range(5):
        rows = read_part(fs, files, p, EDGE_SCHEMA)
        assert rows["u"].to_pylist() == np.flatnonzero(parts == p).tolist()
    assert pq.ParquetFile(tmp_path / "a.parquet").num_row_groups == 3


# ------------------------------------------------------------------ a worker killed


DRIVER = textwrap.dedent("""
    import json, sys
    from pairforge.config import DedupConfig, RayConfig
    from pairforge.pipeline import dedup_stage
    dedup_stage.ROWS_PER_PART = 30_000
    raw, out, address = sys.argv[1:4]
    stats = dedup_stage.run_dedup(raw, out, DedupConfig(), RayConfig(address=address),
                                  force=True)
    print(json.dumps(stats))
""")


def _start_driver(cluster: LocalCluster, raw: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, **cluster.driver_env}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(raw), str(out),
                             cluster.address], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill_worker(cluster: LocalCluster, title: str) -> bool:
    """SIGKILL the worker process of the cluster that runs task ``title`` right now."""
    for node in cluster.started.values():
        for pid in family(node.proc.pid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    os.kill(pid, signal.SIGKILL)
                    return True
            except OSError:
                continue
    return False


@pytest.mark.slow
def test_a_worker_killed_mid_stage_and_a_killed_driver_change_nothing(tmp_path):
    """On a 2-node loopback cluster: SIGKILL the worker running a band-join task (Ray
    retries the task), then a driver killed mid-stage and a rerun; both outputs equal
    the single process's, and nothing of the work folder is left."""
    rows = generated_rows(11, families=400)
    rng = np.random.default_rng(11)
    from dedup_sets import _random_hashes

    filler = _random_hashes(rng, (60_000, 6))  # enough hashes for tasks of a second
    rows += [{"pixel_hash": f"f{i}", "sha256": None, "original_width": 10,
              "original_height": 10, "phash": int(p[0]), "phash_mirror": int(p[1]),
              "crop_phashes": [int(v) for v in p[2:]]} for i, p in enumerate(filler)]
    write_raw(tmp_path / "raw", rows, shards=6)
    expected, expected_stats, _ = oracle(tmp_path / "raw", [], T, str(tmp_path))
    nodes = {"head": (1, {}), "worker": (1, {})}
    with LocalCluster(nodes) as cluster:
        out = tmp_path / "killed" / "dedup"
        driver = _start_driver(cluster, tmp_path / "raw", out)
        killed = False
        deadline = time.monotonic() + 300
        while not killed and driver.poll() is None and time.monotonic() < deadline:
            killed = _kill_worker(cluster, "ray::band_join")
            time.sleep(0.01)
        stdout, stderr = driver.communicate(timeout=600)
        assert killed and driver.returncode == 0, stderr[-3000:]
        stats = json.loads(stdout.strip().splitlines()[-1])
        assert pq.read_table(out / "duplicates.parquet").equals(expected)
        assert {k: stats[k] for k in DECISION_STATS} == expected_stats
        placement = cluster.placement()
        joins = [t for t in placement["tasks"] if t["name"] == "band_join"]
        assert any(t["attempt"] > 0 for t in joins), joins  # Ray retried the lost task

        # a driver killed in the middle, then a rerun
        out2 = tmp_path / "rerun" / "dedup"
        driver = _start_driver(cluster, tmp_path / "raw", out2)
        while not (out2 / "work" / "members").exists() and driver.poll() is None:
            time.sleep(0.05)
        driver.kill()
        driver.wait()
        assert (out2 / "work").exists() and not (out2 / "dedup_stats.json").exists()
        rerun = _start_driver(cluster, tmp_path / "raw", out2)
        stdout, stderr = rerun.communicate(timeout=600)
        assert rerun.returncode == 0, stderr[-3000:]
    assert pq.read_table(out2 / "duplicates.parquet").equals(expected)
    assert (out2 / "index.parquet").exists() and not (out2 / "work").exists()
    _, _, expected_index = oracle(tmp_path / "raw", [], T, str(tmp_path / "rerun"))
    assert read_index_folder(out2 / "index.parquet").equals(expected_index)
