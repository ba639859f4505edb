"""The semantic pass as partitioned Ray tasks (filters/semantic_parts.py): the same output
as the one-process decision (semantic.semantic_duplicates, the oracle) at a size where
k-means trains on a hashed sample and every phase has many tasks, the driver holding no
row's vector beyond the sample, and a worker killed in the middle of the pass."""

from __future__ import annotations

import json
import os
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
from test_semantic_dedup import planted, write_scored_shards

from pairforge.dedup.reference import semantic_duplicates
from pairforge.dedup.semantic import sample_mask
from pairforge.dedup.semantic_partitions import balanced_groups
from pairforge.records import make_key

SHARD_ROWS = 2000


def scored_set(out: Path, n: int, copies: int, dim: int, seed: int
               ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """OUT/raw, OUT/clip and OUT/embeddings for n + copies rows, shards of SHARD_ROWS;
    the keys, vectors and scores."""
    x, _ = planted(n, dim, copies, seed=seed)
    keys = [make_key(i // SHARD_ROWS, i % SHARD_ROWS) for i in range(len(x))]
    scores = np.random.default_rng(seed).uniform(0.1, 0.4, len(x))
    write_scored_shards(out, x, keys, scores.tolist())
    return keys, x, scores


def config(out: Path, address: str | None = None, **semantic):
    from pairforge.config import parse_config

    return parse_config({"input": {"path": "unused", "shard_size": SHARD_ROWS},
                         "output": {"path": str(out)},
                         "ray": {"num_cpus": 2} if address is None else {"address": address},
                         "dedup": {"enabled": False,
                                   "semantic": {"enabled": True, **semantic}},
                         "process": {"clip": {"enabled": True, "threshold": 0.2}}})


def expected(keys: list[str], x: np.ndarray, scores: np.ndarray, stats: dict, **semantic):
    keep = scores >= 0.2
    return semantic_duplicates(pa.array(np.array(keys)[keep]), x[keep],
                               np.full(keep.sum(), 10_000), 0.95, clusters=stats["clusters"],
                               probes=stats["probes"], **semantic)


def test_sample_membership_is_decided_per_key_and_bounded():
    keys = pa.array([make_key(i // 1000, i % 1000) for i in range(50_000)])
    whole = sample_mask(keys, 50_000, 5_000, seed=3)
    parts = np.concatenate([sample_mask(keys.slice(i, 7_000), 50_000, 5_000, seed=3)
                            for i in range(0, 50_000, 7_000)])
    assert np.array_equal(whole, parts)
    assert 4_700 < whole.sum() < 5_300  # binomial: 5,000 +- 4 sigma
    assert not np.array_equal(whole, sample_mask(keys, 50_000, 5_000, seed=4))
    assert sample_mask(keys, 50_000, 60_000, seed=3).all()


def test_balanced_groups_take_each_bucket_with_pairs_once():
    sizes = np.array([1, 9, 0, 4, 1, 1, 30, 2, 2, 5])
    groups = balanced_groups(sizes, buckets=5, groups=3)
    taken = sorted(b for g in groups for b in g)
    # bucket 0 = clusters 0 and 5 (sizes 1, 1): no pair; every other bucket has a pair
    assert taken == [1, 2, 3, 4]
    assert len(groups) == 3 and [6 % 5] in groups  # the largest bucket alone


def test_partitioned_pass_matches_the_one_process_decision(tmp_path, ray_local, monkeypatch):
    """22,000 rows over 11 shards: k-means on a hashed sample capped at 5,000 rows, 6 units,
    6 partitions, 25 pair-search tasks, 2 probes; the output, pairs and counts are the
    oracle's."""
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline import dedup_stage, semantic_stage
    from pairforge.shards.storage import OutputDir

    monkeypatch.setattr(semantic_stage, "ROWS_PER_UNIT", 2 * SHARD_ROWS)
    monkeypatch.setattr(semantic_stage, "GROUP_BYTES", 200_000)
    monkeypatch.setattr(dedup_stage, "ROWS_PER_PART", 3_000)
    keys, x, scores = scored_set(tmp_path, 20_000, 2_000, 32, seed=7)
    cfg = config(tmp_path, rows_per_cluster=300, sample_rows=5_000)
    stats = semantic_stage.run_semantic_dedup(cfg, OutputDir(str(tmp_path)), [ClipStep])
    oracle = expected(keys, x, scores, stats, sample_rows=5_000)
    table = pq.read_table(tmp_path / "dedup" / "semantic.parquet")
    assert table.equals(oracle.duplicates)
    assert len(table) > 500
    for name in ("embeddings", "clusters", "largest_cluster", "pairs", "duplicate_semantic"):
        assert stats[name] == oracle.stats[name], name
    assert 4_500 < stats["sample_rows"] < 5_500 and stats["units"] == 6
    assert stats["partitions"] == 5  # 14,7xx rows CLIP keeps, 3,000 a partition
    assert not (tmp_path / "dedup" / "semantic-work").exists()


# ------------------------------------------------------------------ a worker killed

DRIVER = textwrap.dedent("""
    import json, sys
    import test_semantic_distributed as t
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline import semantic_stage
    from pairforge.pipeline.ray_runtime import init_ray
    from pairforge.shards.storage import OutputDir
    semantic_stage.ROWS_PER_UNIT = t.SHARD_ROWS
    out, address = sys.argv[1:3]
    cfg = t.config(t.Path(out), address, rows_per_cluster=8_000, probes=1)
    init_ray(cfg.ray)
    print(json.dumps(semantic_stage.run_semantic_dedup(cfg, OutputDir(out), [ClipStep])))
""")


def _start_driver(cluster: LocalCluster, out: Path) -> subprocess.Popen:
    env = {**os.environ, **cluster.driver_env,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(out), cluster.address],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_worker(cluster: LocalCluster, title: str) -> bool:
    for node in cluster.started.values():
        for pid in family(node.proc.pid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    os.kill(pid, 9)
                    return True
            except OSError:
                continue
    return False


@pytest.mark.slow
def test_a_worker_killed_mid_pass_and_a_killed_driver_change_nothing(tmp_path):
    """On a 2-node loopback cluster: SIGKILL the worker running a pair search (Ray
    retries it), then a driver killed mid-pass and a rerun; both outputs are the
    oracle's and no work folder is left."""
    keys, x, scores = scored_set(tmp_path / "a", 40_000, 4_000, 64, seed=9)
    with LocalCluster({"head": (1, {}), "worker": (1, {})}) as cluster:
        driver = _start_driver(cluster, tmp_path / "a")
        killed = False
        deadline = time.monotonic() + 300
        while not killed and driver.poll() is None and time.monotonic() < deadline:
            killed = _kill_worker(cluster, "ray::pair_group")
            time.sleep(0.01)
        stdout, stderr = driver.communicate(timeout=600)
        assert killed and driver.returncode == 0, stderr[-3000:]
        stats = json.loads(stdout.strip().splitlines()[-1])
        pairs = [t for t in cluster.placement()["tasks"] if t["name"] == "pair_group"]
        assert any(t["attempt"] > 0 for t in pairs), pairs  # Ray retried the lost task
        oracle = expected(keys, x, scores, stats)
        table = pq.read_table(tmp_path / "a" / "dedup" / "semantic.parquet")
        assert table.equals(oracle.duplicates) and len(table) > 1_000

        # a driver killed in the middle, then a rerun
        (tmp_path / "a" / "dedup" / "semantic_stats.json").unlink()
        driver = _start_driver(cluster, tmp_path / "a")
        while not (tmp_path / "a" / "dedup" / "semantic-work" / "labelled").exists() \
                and driver.poll() is None:
            time.sleep(0.05)
        driver.kill()
        assert driver.wait() == -9  # killed, not finished
        assert (tmp_path / "a" / "dedup" / "semantic-work").exists()
        assert not (tmp_path / "a" / "dedup" / "semantic_stats.json").exists()
        rerun = _start_driver(cluster, tmp_path / "a")
        stdout, stderr = rerun.communicate(timeout=600)
        assert rerun.returncode == 0, stderr[-3000:]
    assert pq.read_table(tmp_path / "a" / "dedup" / "semantic.parquet").equals(
        oracle.duplicates)
    assert not (tmp_path / "a" / "dedup" / "semantic-work").exists()
