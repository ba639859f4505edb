"""The manifest folded over the shards' stats files one at a time, and the dataset files
written streaming with the bytes ``OutputDir.write_json`` writes for the whole content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pairforge.config import PairforgeConfig
from pairforge.pipeline.chain import stage_steps
from pairforge.pipeline.process import dataset_manifest
from pairforge.shards.manifest import Manifest, write_dataset_files
from pairforge.shards.raw import stats_name
from pairforge.shards.storage import RAW_FOLDER, SHARDS_FOLDER, OutputDir


def _dumps(data: object) -> bytes:
    return json.dumps(data, indent=2, sort_keys=True, default=str).encode()


def _streamed(fields: dict, entries: list[dict], tmp_path: Path) -> bytes:
    with Manifest(fields) as manifest:
        for shard_id, entry in enumerate(entries):
            manifest.add_shard(shard_id, entry)
        with open(tmp_path / "m.json", "wb") as f:
            manifest.write(f)
    return (tmp_path / "m.json").read_bytes()


NESTED_FIELDS = {
    "zeta": [1, {"b": None, "a": [True, 2.5]}], "budget": {"p_drop": 0.1},
    "config": {"shards": [], "x": {"shards": {"deep": 1}}},  # "shards" below the top level
    "text": "two\nlines, \"quoted\", é and \u2603", "empty": {}, "none": [],
    "path": Path("/a/b"),  # default=str
    "steps": {"basic": {"ended": {}, "seconds": 0.25}},
}


@pytest.mark.parametrize("count", [0, 1, 3])
def test_a_streamed_manifest_is_the_bytes_of_json_dumps(tmp_path, count):
    entries = [{"name": f"{i:05d}.tar", "samples": i * 7, "budget": None if i else {"p": 0.5},
                "tasks": {"t2i": {"samples": i}}, "status": {"ok": i, "failed": 1},
                "settings_digest": f"d{i}", "rows": []} for i in range(count)]
    expected = _dumps({**NESTED_FIELDS, "shards": entries})
    assert _streamed(NESTED_FIELDS, entries, tmp_path) == expected
    assert _streamed({}, entries, tmp_path) == _dumps({"shards": entries})


def _shard_stats(shard_id: int) -> dict:
    ok = 50 + shard_id % 13
    return {
        "clip_model": f"model-{shard_id}", "clip_threshold": 0.25,
        "settings": {"digest": f"{shard_id:x}"},
        "step_stats": {"basic": {"rows_in": 60, "rows_out": ok, "seconds": 0.001,
                                 "ended": {"too_small": 60 - ok}}},
        "recaption": {"rows": ok, "origin": {"model": ok - 1, "cache": 1}},
        "vocab": {"text": 100, "image": 16},
        "budget": {"p_drop": 0.2, "realized": 0.2, "max_image_tokens": 16,
                   "max_prefix_deviation": float(shard_id % 101)},
        "tasks": {"i2t": {"samples": 1, "image_tokens": 16}, "t2i": {"samples": ok - 1,
                                                                     "image_tokens": 3}},
        "shard": shard_id, "count": 60, "successes": ok,
        "status": {"ok": ok, "too_small": 60 - ok},
    }


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> tuple[OutputDir, list[int]]:
    """2,000 shards' stats files, the ids crossing 99,999 (six-digit names sort as text)."""
    root = tmp_path_factory.mktemp("many")
    ids = list(range(0, 2000 * 60, 60))
    for folder in (SHARDS_FOLDER, RAW_FOLDER):
        (root / folder).mkdir()
    for shard_id in reversed(ids):  # the listing's order is not the shards' order
        (root / SHARDS_FOLDER / stats_name(shard_id)).write_text(
            json.dumps(_shard_stats(shard_id)))
        (root / RAW_FOLDER / stats_name(shard_id)).write_text(json.dumps(
            {"shard": shard_id, "status": {"ok": 60, "failed_download": shard_id % 3}}))
    return OutputDir(str(root)), ids


def test_a_manifest_over_2000_shards_adds_up_exactly(many_shards):
    out, ids = many_shards
    cfg = PairforgeConfig(input={"path": "in.csv"}, output={"path": out.url},
                          process={"clip": {"enabled": True}})
    with dataset_manifest(out, cfg, stage_steps(cfg)) as manifest:
        write_dataset_files(out, manifest)
    written = (Path(out.root) / "manifest.json").read_bytes()
    m = json.loads(written)
    assert written == _dumps(m)  # what write_json of the content writes
    oks = [50 + i % 13 for i in ids]
    assert m["totals"]["samples"] == sum(oks) == 111_997
    assert m["totals"]["tasks"] == {
        "i2t": {"samples": 2000, "image_tokens": 32_000},
        "t2i": {"samples": sum(oks) - 2000, "image_tokens": 6_000}}
    assert m["steps"] == {"basic": {"rows_in": 120_000, "rows_out": sum(oks),
                                    "ended": {"too_small": 120_000 - sum(oks)},
                                    "seconds": 2.0}}
    assert m["recaption"] == {"rows": sum(oks), "origin": {"cache": 2000,
                                                           "model": sum(oks) - 2000}}
    assert m["budget"]["p_drop"] == 0.2
    assert m["budget"]["max_prefix_deviation_tokens"] == 100.0
    assert m["budget"]["realized_i2t_share"] == 32_000 / 38_000
    assert m["vocab"] == {"text": 100, "image": 16}
    assert m["models"]["clip"] == "model-0"  # the first shard's
    failed = sum(i % 3 for i in ids)
    assert m["funnel"] == {"input_rows": 120_000 + failed,
                           "download": {"ok": 120_000, "failed_download": failed},
                           "final": {"ok": sum(oks), "too_small": 120_000 - sum(oks)}}
    assert [s["name"] for s in m["shards"]] == [f"{i:05d}.tar" for i in ids]
    assert m["shards"][1] == {"name": "00060.tar", "samples": 58, "rows": 60,
                              "tasks": _shard_stats(60)["tasks"],
                              "budget": _shard_stats(60)["budget"], "settings_digest": "3c",
                              "status": {"ok": 58, "too_small": 2}}


def test_sizes_and_the_wids_index_are_the_bytes_of_json_dumps(many_shards):
    out, ids = many_shards
    cfg = PairforgeConfig(input={"path": "in.csv"}, output={"path": out.url})
    with dataset_manifest(out, cfg, stage_steps(cfg)) as manifest:
        write_dataset_files(out, manifest)
    sizes = {f"{i:05d}.tar": 50 + i % 13 for i in ids}
    root = Path(out.root)
    assert (root / "sizes.json").read_bytes() == _dumps(sizes)
    names = list(json.loads((root / "sizes.json").read_bytes()))
    assert names.index("100020.tar") < names.index("10020.tar")  # as text, like sort_keys
    assert (root / SHARDS_FOLDER / "sizes.json").read_bytes() == _dumps(sizes)
    assert (root / "index.wids.json").read_bytes() == _dumps({
        "__kind__": "wids-shard-index-v1", "wids_version": 1, "name": "pairforge",
        "shardlist": [{"url": f"shards/{i:05d}.tar", "nsamples": 50 + i % 13} for i in ids]})


def test_an_empty_dataset_writes_the_empty_files(tmp_path):
    out = OutputDir(str(tmp_path))
    out.makedirs(SHARDS_FOLDER)  # stage 3 makes it before it writes shards
    cfg = PairforgeConfig(input={"path": "in.csv"}, output={"path": str(tmp_path)})
    with dataset_manifest(out, cfg, stage_steps(cfg)) as manifest:
        write_dataset_files(out, manifest)
    m = json.loads((tmp_path / "manifest.json").read_bytes())
    assert (tmp_path / "manifest.json").read_bytes() == _dumps(m)
    assert m["shards"] == [] and m["totals"] == {"samples": 0, "tasks": {}}
    assert m["funnel"] == {"input_rows": 0, "download": {}, "final": {}}
    assert m["recaption"] is None and m["vocab"] is None
    assert (tmp_path / "sizes.json").read_bytes() == b"{}"
    assert json.loads((tmp_path / "index.wids.json").read_bytes())["shardlist"] == []


def test_shards_made_with_different_p_drop_cannot_share_a_manifest(tmp_path):
    out = OutputDir(str(tmp_path))
    for folder in (SHARDS_FOLDER, RAW_FOLDER):
        out.makedirs(folder)
    for shard_id, p_drop in ((0, 0.2), (1, 0.3)):
        stats = _shard_stats(shard_id)
        stats["budget"]["p_drop"] = p_drop
        out.write_json(stats, SHARDS_FOLDER, stats_name(shard_id))
        out.write_json({"status": {"ok": 1}}, RAW_FOLDER, stats_name(shard_id))
    cfg = PairforgeConfig(input={"path": "in.csv"}, output={"path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"different p_drop: \[0.2, 0.3\]"):
        dataset_manifest(out, cfg, stage_steps(cfg))
