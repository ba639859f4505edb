"""Semantic dedup (filters/semantic.py): the k-means + in-cluster search against brute force
on planted embeddings (no real CLIP weights here), the survivor rule, and the Ray pass of
stage 3 on embedding files as the CLIP step writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from references import brute_force_pairs

from pairforge.dedup.reference import semantic_duplicates
from pairforge.dedup.semantic import (
    assign,
    cluster_pairs,
    duplicates_from_pairs,
    group_pairs,
    kmeans,
    normalise,
)
from pairforge.records import Status, make_key

THRESHOLD = 0.95


def brute_pairs(x: np.ndarray, threshold: float) -> tuple[set, set]:
    """Independent reference: the whole similarity matrix at once, in float64. Returns the
    pairs over the threshold and those within float32 rounding of it (either answer is
    right for those, so comparisons leave them out)."""
    unit = x.astype(np.float64)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    sims = unit @ unit.T
    upper = np.triu(np.ones(sims.shape, bool), 1)
    over = set(zip(*(a.tolist() for a in np.nonzero(upper & (sims >= threshold))), strict=True))
    near = set(zip(*(a.tolist() for a in np.nonzero(upper & (abs(sims - threshold) < 1e-5))),
                   strict=True))
    return over, near


def same_pairs(found: np.ndarray, x: np.ndarray, threshold: float,
               keep: callable = lambda i, j: True) -> None:
    over, near = brute_pairs(x, threshold)
    got = set(map(tuple, found.tolist()))
    assert got - near == {p for p in over if keep(*p)} - near


def planted(n: int, dim: int, copies: int, seed: int, topics: int = 20,
            spread: float = 0.6) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``n`` embeddings around ``topics`` directions (so k-means has real structure and
    distinct rows of a topic are alike, but under the threshold), plus ``copies`` planted
    near-duplicates (cosine ~0.97-0.995 to their source)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, dim))
    base = centres[rng.integers(0, topics, n)] * spread + rng.standard_normal((n, dim))
    sources = rng.choice(n, copies, replace=False)
    noise = rng.uniform(0.05, 0.2, (copies, 1)) * rng.standard_normal((copies, dim))
    dups = base[sources] + noise * np.linalg.norm(base[sources], axis=1, keepdims=True) / (
        np.sqrt(dim))
    x = np.concatenate([base, dups]).astype(np.float32)
    return x, [(int(s), n + i) for i, s in enumerate(sources)]


def keys_for(n: int) -> pa.Array:
    return pa.array([make_key(i // 1000, i % 1000) for i in range(n)], pa.string())


def test_in_cluster_search_is_exactly_brute_force_within_each_cluster():
    """Whatever the clusters, the pairs found are all pairs of a cluster over the threshold."""
    x, _ = planted(3000, 64, 300, seed=1)
    unit = normalise(x)
    labels = assign(unit, kmeans(unit, 12, iterations=5, seed=0))
    found, sims = group_pairs(unit, labels, list(range(12)), 0.4)  # a low bar: many pairs
    assert len(found) > 5_000
    same_pairs(found, x, 0.4, keep=lambda i, j: labels[i] == labels[j])
    assert np.allclose(sims, np.einsum("ij,ij->i", unit[found[:, 0]], unit[found[:, 1]]),
                       atol=1e-5)


def test_blocked_pair_search_matches_the_whole_matrix(monkeypatch):
    """The block loop (4,096 rows a block in production) misses no pair at block edges."""
    import pairforge.dedup.semantic as semantic

    monkeypatch.setattr(semantic, "_BLOCK", 7)
    x, _ = planted(300, 16, 60, seed=2, topics=3)
    pairs, _ = cluster_pairs(normalise(x), np.arange(len(x)), 0.8)
    same_pairs(pairs, x, 0.8)


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_duplicates_decided_as_brute_force_decides(seed):
    """k-means over 5,000 rows in 25 clusters: the same duplicates table as components of
    all pairs compared, and every planted copy dropped beside its source."""
    x, plants = planted(5000, 128, 300, seed=seed)
    keys = keys_for(len(x))
    area = np.random.default_rng(seed).integers(1, 4, len(x)) * 10_000
    result = semantic_duplicates(keys, x, area, THRESHOLD, clusters=25, seed=seed)
    reference = brute_force_pairs(x, THRESHOLD)
    same_pairs(reference, x, THRESHOLD)
    expected = duplicates_from_pairs(keys, normalise(x), area, reference)
    assert result.duplicates.equals(expected)
    assert result.stats["pairs"] == len(reference) >= len(plants)
    dropped = {r["key"]: r for r in result.duplicates.to_pylist()}
    for source, copy in plants:
        pair = {keys[source].as_py(), keys[copy].as_py()}
        assert len(pair & set(dropped)) == 1  # one of the two goes, the other survives
        gone = (pair & set(dropped)).pop()
        assert dropped[gone]["kept_key"] in pair and dropped[gone]["similarity"] >= THRESHOLD
    assert {r["kind"] for r in dropped.values()} == {Status.DUPLICATE_SEMANTIC}


def test_more_probes_find_the_pairs_a_cluster_boundary_splits():
    """One probe (SemDeDup) misses pairs split by k-means; two find more; probing every
    cluster is the all-pairs comparison itself."""
    x, _ = planted(3000, 64, 200, seed=5, topics=200, spread=0.3)
    keys = keys_for(len(x))
    area = np.ones(len(x))
    found = {p: semantic_duplicates(keys, x, area, 0.9, clusters=10, probes=p).stats["pairs"]
             for p in (1, 2, 10)}
    over, near = brute_pairs(x, 0.9)
    assert found[1] < found[2] <= found[10]
    assert abs(found[10] - len(over)) <= len(near)
    print(f"\n[semantic] pairs found with 1/2/10 probes of 10 clusters: {found}, all pairs "
          f"{len(over)}")


def test_survivor_rule_largest_then_lowest_key_whatever_the_order():
    x, plants = planted(2000, 64, 100, seed=3)
    keys = keys_for(len(x))
    area = np.full(len(x), 100)
    source, copy = plants[0]
    area[copy] = 400  # the copy is the larger original: it survives
    result = semantic_duplicates(keys, x, area, THRESHOLD, clusters=8)
    dropped = {r["key"]: r for r in result.duplicates.to_pylist()}
    assert dropped[keys[source].as_py()]["kept_key"] == keys[copy].as_py()
    for s, c in plants[1:]:  # same area: the lower key survives
        if keys[c].as_py() in dropped and dropped[keys[c].as_py()]["kept_key"] == keys[s].as_py():
            assert keys[s].as_py() < keys[c].as_py()
    kept = {r["kept_key"] for r in dropped.values()}
    assert not kept & set(dropped)  # every named survivor is kept
    order = np.random.default_rng(0).permutation(len(x))
    again = semantic_duplicates(keys.take(pa.array(order)), x[order], area[order], THRESHOLD,
                                clusters=8)
    assert again.duplicates.equals(result.duplicates)


# --------------------------------------------------------------------- the pass on Ray


def write_scored_shards(out: Path, x: np.ndarray, keys: list[str], scores: list[float]) -> None:
    """OUT/raw, OUT/clip and OUT/embeddings as stage 1 and CLIP's scoring pass leave them."""
    from pairforge.records import raw_schema
    from pairforge.shards.storage import OutputDir
    from pairforge.shards.training import write_embeddings

    folder = OutputDir(str(out))
    for name in ("raw", "clip"):
        (out / name).mkdir(parents=True, exist_ok=True)
    shard_of = [int(k[:5]) for k in keys]
    for shard in sorted(set(shard_of)):
        rows = [i for i, s in enumerate(shard_of) if s == shard]
        columns = {n: [None] * len(rows) for n in raw_schema().names}
        columns.update(key=[keys[i] for i in rows], status=["ok"] * len(rows),
                       original_width=[100] * len(rows), original_height=[100] * len(rows))
        pq.write_table(pa.table(columns, schema=raw_schema()), out / "raw" / f"{shard:05d}.parquet")
        (out / "raw" / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": len(rows), "status": {"ok": len(rows)}}))
        pq.write_table(pa.table({"key": [keys[i] for i in rows], "status": ["ok"] * len(rows),
                                 "clip_score": pa.array([scores[i] for i in rows], pa.float32())}),
                       out / "clip" / f"{shard:05d}.parquet")
        write_embeddings(folder, shard, [keys[i] for i in rows], [x[i].tolist() for i in rows])


def test_semantic_pass_on_ray_matches_the_algorithm_and_is_reused(tmp_path, ray_local):
    from pairforge.config import parse_config
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.plan import decisions
    from pairforge.pipeline.semantic_stage import run_semantic_dedup

    x, _ = planted(3000, 64, 200, seed=4)
    keys = [make_key(i // 1000, i % 1000) for i in range(len(x))]
    rng = np.random.default_rng(4)
    scores = rng.uniform(0.1, 0.4, len(x)).tolist()
    write_scored_shards(tmp_path, x, keys, scores)
    cfg = parse_config({"input": {"path": "unused", "shard_size": 1000},
                        "output": {"path": str(tmp_path)}, "ray": {"num_cpus": 2},
                        "dedup": {"enabled": False,
                                  "semantic": {"enabled": True, "rows_per_cluster": 200}},
                        "process": {"clip": {"enabled": True, "threshold": 0.2}}})
    stats = run_semantic_dedup(cfg, _out(tmp_path), steps=[ClipStep])
    table = pq.read_table(tmp_path / "dedup" / "semantic.parquet")
    # only rows CLIP keeps take part: a survivor dropped for its score would take its copies
    keep = np.array(scores) >= 0.2
    expected = semantic_duplicates(pa.array(np.array(keys)[keep]), x[keep],
                                   np.full(keep.sum(), 10_000), 0.95, clusters=stats["clusters"],
                                   probes=stats["probes"])
    assert table.equals(expected.duplicates)
    assert stats["embeddings"] == keep.sum() and stats["duplicate_semantic"] == len(table) > 50
    # stage 3's plan skips them and the writer gives them their status
    planned = decisions(_out(tmp_path), cfg)
    counts = planned.counts()
    assert sum(counts.values()) == len(table)
    per_shard = [planned.of_shard(shard) for shard in counts]
    assert [len(d) for d in per_shard] == list(counts.values())
    assert sum(len(d) for d in per_shard) == len(table)
    assert {kind for d in per_shard for kind, _ in d.values()} == {"duplicate_semantic"}
    # a finished pass is reused while its inputs are the same
    (tmp_path / "dedup" / "semantic.parquet").write_bytes(b"changed")
    assert run_semantic_dedup(cfg, _out(tmp_path), steps=[ClipStep]) == stats


def _out(path: Path):
    from pairforge.shards.storage import OutputDir

    return OutputDir(str(path))


# ------------------------------------------------------------- through stage 3 end to end

# The tiny random-weight CLIP of tests/test_process_stage.py (no real weights here).
from test_process_stage import tiny_clip  # noqa: E402,F401  (a fixture)


def test_stage3_drops_semantic_copies_beside_their_kept_rows(tmp_path, tiny_clip, ray_local):  # noqa: F811
    """Photos and half-size copies (hash dedup off): stage 3's semantic pass drops each copy
    as duplicate_semantic naming the photo it kept, and the rest go on."""
    from conftest import COCO_IMAGES, download_raw
    from loopback_server import LoopbackServer
    from PIL import Image

    from pairforge.config import parse_config
    from pairforge.pipeline.entry import RunOptions
    from pairforge.pipeline.process import run_process

    photos = sorted(COCO_IMAGES.iterdir())[:10]
    served = tmp_path / "served"
    served.mkdir()
    for f in photos:
        (served / f.name).write_bytes(f.read_bytes())
    for f in photos[:3]:
        image = Image.open(f)
        image.resize((image.width // 2, image.height // 2)).save(served / f"half_{f.name}",
                                                                  quality=90)
    # each copy beside its photo, so a shard holds both kept rows and copies
    names = [n for f in photos[:3] for n in (f.name, f"half_{f.name}")]
    names += [f.name for f in photos[3:]]
    with LoopbackServer(served, "127.0.0.1") as server:
        raw = download_raw(tmp_path, [(server.url("/img/" + n), f"a photo {i}")
                                      for i, n in enumerate(names)], shard_size=5)
    cfg = parse_config({"input": {"path": "unused", "shard_size": 5},
                        "output": {"path": str(raw)}, "ray": {"num_cpus": 2},
                        "dedup": {"enabled": False,
                                  "semantic": {"enabled": True, "threshold": 0.995}},
                        "process": {"basic": {"min_image_side": 64},
                                    "clip": {"enabled": True, "batch_size": 8,
                                             "mode": "score_only", "save_embeddings": True,
                                             **tiny_clip}}})
    summary = run_process(cfg, RunOptions(show_progress=False))
    rows = {}
    for part in sorted((raw / "shards").glob("*.parquet")):
        rows.update({r["key"]: r for r in pq.read_table(part).to_pylist()})
    by_url = {r["url"].rsplit("/", 1)[1]: r for r in rows.values()}
    dropped = {n: r for n, r in by_url.items() if r["status"] == Status.DUPLICATE_SEMANTIC}
    print(f"\n[semantic] {summary['semantic_dedup']}, dropped {sorted(dropped)}")
    assert {n.removeprefix("half_") for n in dropped} == {f.name for f in photos[:3]}
    for name, row in dropped.items():
        twin = by_url[name.removeprefix("half_") if name.startswith("half_") else f"half_{name}"]
        assert row["duplicate_of"] == twin["key"] and twin["status"] == "ok"
    assert sum(r["status"] == "ok" for r in rows.values()) == 10
    assert summary["semantic_dedup"]["duplicate_semantic"] == 3
    # save_embeddings: the writing pass leaves the scoring pass's files whole (it embeds 10
    # rows: the copies skip CLIP), so a rerun finds the same inputs and the same duplicates
    embedded = [k for f in sorted((raw / "embeddings").glob("*_keys.json"))
                for k in json.loads(f.read_text())]
    assert sorted(embedded) == sorted(rows)
    again = run_process(cfg, RunOptions(show_progress=False))
    assert again["semantic_dedup"] == summary["semantic_dedup"]
    # every decision explained: counts per kind, and each dropped row beside the kept one
    from pairforge.inspection.contact_sheet import TILE, show
    from pairforge.inspection.duplicates import summary_lines

    final = json.loads((raw / "manifest.json").read_text())["funnel"]["final"]
    lines = summary_lines(_out(raw), final)
    assert lines[0] == ("duplicates: 3 (exact 0, near 0, mirror 0, crop 0, semantic 3)")
    assert "13 CLIP embeddings in 1 k-means clusters" in lines[1]
    sheet = tmp_path / "duplicates.png"
    assert show(str(raw), str(sheet), duplicates=True) == 3
    assert Image.open(sheet).width == 4 * 2 * TILE  # a kept image beside every dropped one
