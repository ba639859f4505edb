"""`pairforge build` end to end: download, dedup and process through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import COCO_IMAGES
from loopback_server import LoopbackServer
from PIL import Image, ImageOps


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """Eight COCO photos plus an exact copy, a PNG, a q60 re-encode, a half-size copy, a
    mirror and a copy with 10 % cut off every side."""
    folder = tmp_path_factory.mktemp("planted")
    names = sorted(p.name for p in COCO_IMAGES.glob("*.jpg"))[:8]
    for name in names:
        (folder / name).write_bytes((COCO_IMAGES / name).read_bytes())
    first = Image.open(COCO_IMAGES / names[0]).convert("RGB")
    (folder / "copy.jpg").write_bytes((COCO_IMAGES / names[0]).read_bytes())
    first.save(folder / "lossless.png")
    Image.open(COCO_IMAGES / names[1]).save(folder / "q60.jpg", quality=60)
    second = Image.open(COCO_IMAGES / names[2])
    second.resize((second.width // 2, second.height // 2)).save(folder / "half.jpg", quality=90)
    ImageOps.mirror(Image.open(COCO_IMAGES / names[3])).save(folder / "mirror.jpg", quality=95)
    fifth = Image.open(COCO_IMAGES / names[4])
    dx, dy = round(fifth.width * 0.1), round(fifth.height * 0.1)
    fifth.crop((dx, dy, fifth.width - dx, fifth.height - dy)).save(folder / "crop10.jpg",
                                                                   quality=95)
    return folder


def test_build_drops_planted_duplicates_and_the_funnel_adds_up(tmp_path, planted, ray_env):
    names = sorted(p.name for p in planted.glob("sample_*.jpg"))
    variants = ["copy.jpg", "lossless.png", "q60.jpg", "half.jpg", "mirror.jpg", "crop10.jpg"]
    with LoopbackServer(planted) as server:
        urls = [server.url(f"/img/{n}") for n in names + variants] + [server.url("/html")]
        rows = [f"{u},a photograph of something number {i}" for i, u in enumerate(urls)]
        (tmp_path / "in.csv").write_text("url,caption\n" + "\n".join(rows) + "\n")
        cfg = {"input": {"path": str(tmp_path / "in.csv"), "shard_size": 5},
               "output": {"path": str(tmp_path / "out")},
               "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
               "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"],
                            "image": {"image_size": 160}},  # < 2x: no JPEG draft
               "process": {"basic": {"min_image_side": 64}}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                                 str(tmp_path / "c.yaml"), "-q"], capture_output=True,
                                text=True, timeout=600, env=ray_env)
    assert result.returncode == 0, result.stderr
    assert "dedup:" in result.stderr and "training shards:" in result.stderr

    out = tmp_path / "out"
    table = pq.read_table(sorted((out / "shards").glob("*.parquet"))).to_pylist()
    status = {r["key"]: r["status"] for r in table}
    assert len(status) == len(urls)  # every input row, exactly once
    key = {name: f"{i // 5:05d}{i % 5:04d}" for i, name in enumerate(names + variants)}
    # copy.jpg and lossless.png have the first photo's pixels; q60/half are near copies.
    assert status[key["copy.jpg"]] == "duplicate_exact"
    assert status[key["lossless.png"]] == "duplicate_exact"
    assert status[key["q60.jpg"]] == "duplicate_near"
    assert status[key["half.jpg"]] == "duplicate_near"
    assert status[key["mirror.jpg"]] == "duplicate_mirror"
    assert status[key["crop10.jpg"]] == "duplicate_crop"
    assert all(status[key[n]] == "ok" for n in names)  # the originals survive
    assert list(status.values()).count("not_an_image") == 1
    by_key = {r["key"]: r for r in table}
    assert by_key[key["half.jpg"]]["duplicate_of"] == key[names[2]]

    dedup = json.loads((out / "dedup" / "dedup_stats.json").read_text())
    assert dedup["duplicate_exact"] == 2 and dedup["duplicate_near"] == 2
    assert dedup["duplicate_mirror"] == 1 and dedup["duplicate_crop"] == 1
    assert by_key[key["crop10.jpg"]]["duplicate_of"] == key[names[4]]
    raw_total = sum(json.loads(p.read_text())["count"] for p in (out / "raw").glob("*_stats.json"))
    assert raw_total == len(urls)
    # every dropped duplicate beside the row it was dropped for, through the CLI
    sheet = tmp_path / "duplicates.png"
    shown = subprocess.run([sys.executable, "-m", "pairforge.cli", "show", str(out),
                            "--duplicates", "-o", str(sheet)], capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "6 samples" in shown.stdout + shown.stderr and sheet.exists()
