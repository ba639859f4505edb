"""Hostile input cannot take a stage-1 worker down (issue 46): every image of
``hostile_images.HOSTILE`` (strips in every format, a spacer, frame, page and decompression
bombs, a lying icon) ends with its status within seconds, the task holding under 1 GiB,
and the ordinary rows beside them are ok. Under the plan checks, the memory guard ends a
row that still blows up, not the task."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import COCO_IMAGES
from hostile_images import HOSTILE, pillow_bytes, png_bytes
from loopback_server import LoopbackServer
from PIL import Image

from pairforge.config import ImageConfig, parse_config
from pairforge.download.imageproc import ImageFailure, process_image
from pairforge.pipeline.download_stage import run_download
from pairforge.pipeline.entry import RunOptions
from pairforge.records import Status

ORDINARY = ["sample_5.jpg", "sample_10.jpg", "sample_15.jpg", "sample_20.jpg"]
TASK_MEMORY_CAP = 1024  # MiB: the bound on the shard's process


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory: pytest.TempPathFactory):
    """A loopback server with every hostile image and four COCO photos."""
    folder = tmp_path_factory.mktemp("hostile")
    for name, make, _ in HOSTILE:
        (folder / name).write_bytes(make())
    for name in ORDINARY:
        (folder / name).write_bytes((COCO_IMAGES / name).read_bytes())
    with LoopbackServer(folder) as server:
        yield folder, server


def _config(root: Path, rows: list[str], server: LoopbackServer, **download) -> dict:
    lines = ["url,caption"] + [f"{server.url('/img/' + name)},\"{name}\"" for name in rows]
    (root / "in.csv").write_text("\n".join(lines) + "\n")
    return {"input": {"path": str(root / "in.csv"), "shard_size": len(rows)},
            "output": {"path": str(root / "out")},
            "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"], **download}}


@pytest.mark.parametrize(("name", "make", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_each_hostile_image_ends_with_its_status_at_once(name, make, status):
    data = make()
    started = time.perf_counter()
    result = process_image(data, ImageConfig())
    seconds = time.perf_counter() - started
    found = result.status.value if isinstance(result, ImageFailure) else "ok"
    assert found == status, getattr(result, "error", None)
    assert seconds < 5, f"{name}: {seconds:.1f} s for {len(data)} bytes"
    if status == "ok":  # a frame or page bomb gives its first frame, resized as usual
        assert (result.width, result.height) == (256, 256)


def test_a_resize_past_the_output_cap_is_refused_from_the_plan():
    strip = png_bytes(2000, 10)  # keep_ratio 256: 51200x256 = 13.1 M pixels
    refused = process_image(strip, ImageConfig())
    assert isinstance(refused, ImageFailure) and refused.status == Status.TOO_LARGE
    assert "makes 51200x256 (13107200 pixels), over max_output_pixels=4194304" in refused.error
    assert not isinstance(process_image(strip, ImageConfig(max_output_pixels=14_000_000)),
                          ImageFailure)
    # the other modes make at most image_size squared from the same strip
    for mode in ("border", "keep_ratio_largest"):
        done = process_image(strip, ImageConfig(resize_mode=mode))
        assert not isinstance(done, ImageFailure), done
    # center_crop resizes before it crops: the intermediate image counts
    cropped = process_image(strip, ImageConfig(resize_mode="center_crop"))
    assert isinstance(cropped, ImageFailure) and cropped.status == Status.TOO_LARGE


def test_a_jpeg_is_capped_at_its_reduced_decode_scale():
    photo = pillow_bytes(Image.new("RGB", (4000, 3000), (90, 120, 200)), "JPEG")
    cfg = ImageConfig(max_decoded_pixels=1_000_000)  # 12 M stored, 1/8 scale: 187,500
    assert not isinstance(process_image(photo, cfg), ImageFailure)
    whole = process_image(photo, cfg, draft=False)
    assert isinstance(whole, ImageFailure) and "over max_decoded_pixels" in whole.error


def test_a_shard_of_hostile_rows_ends_every_row_within_bounds(tmp_path, hostile_site):
    """Real HTTP, real Ray: the stage finishes in seconds, the task stays under 1 GiB (its
    memory guard's samples, in the shard's stats), and the ordinary rows are ok. The stage
    runs as a user runs it, `pairforge download` with a Ray of its own: a worker of the
    suite's shared Ray may have run stage-3 tasks before (torch imported, ~1 GB resident),
    and the guard samples the whole worker process."""
    import yaml

    _, server = hostile_site
    names = [name for name, _, _ in HOSTILE] + ORDINARY
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(_config(tmp_path, names, server)))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pairforge.cli", "download",
                           str(tmp_path / "cfg.yaml"), "-q"], capture_output=True, text=True,
                          timeout=300)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    rows = pq.read_table(tmp_path / "out" / "raw" / "00000.parquet").to_pylist()
    found = {r["url"].rsplit("/", 1)[1]: r["status"] for r in rows}
    assert found == {**{name: status for name, _, status in HOSTILE},
                     **dict.fromkeys(ORDINARY, "ok")}
    assert all(r["error"] for r in rows if r["status"] != "ok")
    stats = json.loads((tmp_path / "out" / "raw" / "00000_stats.json").read_text())
    assert 0 < stats["peak_resident_mib"] < TASK_MEMORY_CAP
    assert seconds < 120, seconds  # Ray's start included; the rows take a few seconds


_GUARDED_RUN = textwrap.dedent("""
    import json, sys
    from pairforge.config import parse_config
    from pairforge.download.memory_guard import resident_bytes
    from pairforge.download.shard import download_shard
    from pairforge.pipeline.contract import shard_config
    from pairforge.pipeline.download_stage import input_shards
    cfg = parse_config(json.loads(sys.argv[1]))
    # the limit: what this process holds now, plus room for ordinary photos, not for the
    # 32-million-pixel PNG (~340 MiB of buffers)
    limit = resident_bytes() // 2**20 + 150
    cfg = cfg.model_copy(update={"download": cfg.download.model_copy(
        update={"max_task_memory_mb": limit})})
    with input_shards(cfg) as shards:
        stats = download_shard(shards[0], shard_config(cfg), {"digest": "test"})
    print(json.dumps({"limit": limit, "peak": stats["peak_resident_mib"]}))
""")


def test_the_memory_guard_ends_the_row_not_the_task(tmp_path, hostile_site):
    """A row whose image passes every cap and still takes more memory than the task may
    hold: the first try ends (as Ray would see a dead worker) after recording the row; the
    retry ends that row too_large without fetching it and writes every other row."""
    _, server = hostile_site
    names = ["sample_5.jpg", "png_bomb_under_decode_cap", "sample_10.jpg"]
    cfg = _config(tmp_path, names, server, image_threads=1)
    argv = [sys.executable, "-c", _GUARDED_RUN, json.dumps(cfg)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert first.returncode == 75, first.stderr[-2000:]
    assert "pairforge memory guard" in first.stderr
    raw = tmp_path / "out" / "raw"
    recorded = json.loads((raw / "00000.memory_guard.json").read_text())
    assert list(recorded["rows"]) == ["000000001"]
    assert not (raw / "00000_stats.json").exists()
    hits = server.hits("/img/png_bomb_under_decode_cap")
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert server.hits("/img/png_bomb_under_decode_cap") == hits  # not fetched again
    rows = pq.read_table(raw / "00000.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "too_large", "ok"]
    assert "max_task_memory_mb" in rows[1]["error"]
    assert not (raw / "00000.memory_guard.json").exists()


@pytest.mark.usefixtures("ray_local")
def test_ray_runs_a_guarded_task_again_and_the_stage_completes(tmp_path, hostile_site):
    """The same through Ray: the worker that the guard ends is a system failure, which Ray
    retries; the stage completes with the row too_large and the others ok."""
    _, server = hostile_site
    calm = tmp_path / "calm"
    calm.mkdir()
    run_download(parse_config(_config(calm, ORDINARY, server)), RunOptions(show_progress=False))
    held = json.loads((calm / "out" / "raw" / "00000_stats.json").read_text())
    names = ["sample_5.jpg", "png_bomb_under_decode_cap", "sample_10.jpg"]
    cfg = _config(tmp_path, names, server, image_threads=1,
                  max_task_memory_mb=held["peak_resident_mib"] + 150)
    run_download(parse_config(cfg), RunOptions(show_progress=False))
    rows = pq.read_table(tmp_path / "out" / "raw" / "00000.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "too_large", "ok"]
    assert "max_task_memory_mb" in rows[1]["error"]
    assert not (tmp_path / "out" / "raw" / "00000.memory_guard.json").exists()


def test_the_guard_reads_statm_held_open_and_closes_it(monkeypatch) -> None:
    """The sampling thread reads /proc/self/statm from one descriptor (a third less CPU
    than opening it per sample) and gives it back when the guard ends."""
    from pairforge.download import memory_guard

    opened: list[int | None] = []

    def open_statm() -> int | None:
        opened.append(memory_guard.os.open(memory_guard._STATM, memory_guard.os.O_RDONLY))
        return opened[-1]

    monkeypatch.setattr(memory_guard, "open_statm", open_statm)

    class _NoRows:
        def reason(self, key: str) -> None:
            return None

    guard = memory_guard.MemoryGuard(None, _NoRows())  # type: ignore[arg-type]
    with guard:
        time.sleep(4 * memory_guard.PERIOD_S)
        fd = opened[0]
        held, fresh = memory_guard.resident_bytes(fd), memory_guard.resident_bytes()
        assert held and fresh and abs(held - fresh) < 64 * 2**20
    assert len(opened) == 1 and guard.peak_mib and guard.peak_mib > 0
    with contextlib.suppress(FileNotFoundError):  # closed: the number is free, or
        assert not os.readlink(f"/proc/self/fd/{fd}").endswith("/statm")  # another's
