"""Shared by bench/clip.py and bench/vq.py: a model step inside stage 3 against a bare loop.

Raw shards of COCO sample photos are made with stage 1 (loopback HTTP). Each side runs on
N and on 2N images. The whole-run rate includes fixed costs (the stage starts a Ray worker
that imports torch and loads the model, Ray Data's executor, the writers); the marginal
rate N / (t(2N) - t(N)) is the per-image throughput once running, which is what a build of
millions of images sees. Both sides make one unmeasured warm-up run first.
"""

from __future__ import annotations

import csv
import io
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COCO = ROOT.parent / "shared" / "data" / "coco-sample"
sys.path.insert(0, str(ROOT / "tests"))


def make_raw(out: Path, n: int, image_size: int = 256, shard_size: int = 1000,
             unique: int | None = None) -> None:
    """Stage-1 raw shards of n COCO sample photos: the first ``unique`` (default n) photos,
    listed again from the start (same URL, same pixels) until there are n rows."""
    from loopback_server import LoopbackServer

    from pairforge.config import parse_config
    from pairforge.pipeline.runner import run_download

    with open(COCO / "captions.csv", newline="") as f:
        rows = [(r["filename"], r["caption"].strip()) for r in csv.DictReader(f)]
    rows = rows[:unique or len(rows)]
    rows = (rows * (n // len(rows) + 1))[:n]
    with LoopbackServer(COCO / "images") as server:
        lines = ["url,caption"] + [f"{server.url('/img/' + name)},\"{cap}\"" for name, cap in rows]
        (out.parent / f"{out.name}.csv").write_text("\n".join(lines) + "\n")
        cfg = parse_config({"input": {"path": str(out.parent / f"{out.name}.csv"),
                                      "shard_size": shard_size},
                            "output": {"path": str(out)},
                            "download": {"allow_addresses": ["127.0.0.1/32"],
                                         "image": {"image_size": image_size}}})
        run_download(cfg, show_progress=False)


def raw_images(raw: Path) -> list[tuple[bytes, str]]:
    """(jpg bytes, caption) of every raw sample, in key order."""
    import webdataset as wds

    tars = sorted(str(p) for p in raw.glob("*.tar"))
    return [(s["jpg"], s["txt"].decode()) for s in wds.WebDataset(tars, shardshuffle=False)]


def decode(data: bytes):  # noqa: ANN201 - a PIL image
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def stage_seconds(out: Path, process: dict[str, Any]) -> tuple[float, int]:
    """Seconds of `run_process` with only the given steps, and the ok rows it wrote."""
    from pairforge.config import parse_config
    from pairforge.pipeline.process import run_process

    cfg = parse_config({"input": {"path": "unused"}, "output": {"path": str(out)},
                        "dedup": {"enabled": False},
                        "process": {"basic": {"enabled": False}, **process}})
    start = time.perf_counter()
    summary = run_process(cfg, show_progress=False)
    return time.perf_counter() - start, summary["status"].get("ok", 0)


WARMUP = 40


def compare(n: int, bare: Callable[[Path], tuple[float, int]], process: dict[str, Any],
            label: str) -> None:
    """Print whole-run and marginal images/s of the bare loop and the stage on n and 2n."""
    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    with tempfile.TemporaryDirectory() as tmp:
        warmup = min(WARMUP, n // 2)  # a few images warm up; slow models take fewer
        outs = {size: Path(tmp) / f"out{size}" for size in (warmup, n, 2 * n)}
        for size, out in outs.items():
            make_raw(out, size)
        # All bare runs first, then the stage runs: Ray's idle workers stay out of the way.
        bares = {size: bare(out / "raw") for size, out in outs.items()}
        init_ray(RayConfig())  # started before the stage clock runs
        # A first, unmeasured run on a few images, on both sides, so that both measured
        # runs start alike (Ray's worker processes have imported torch; caches are warm).
        stage_seconds(outs.pop(warmup), process)
        results = {size: (bares[size], stage_seconds(out, process))
                   for size, out in outs.items()}
    print(label)
    for size, ((bare_s, bare_n), (stage_s, stage_n)) in results.items():
        print(f"  {size:4d} images: bare {bare_s:6.1f} s = {bare_n / bare_s:7.2f} images/s, "
              f"stage {stage_s:6.1f} s = {stage_n / stage_s:7.2f} images/s, "
              f"ratio {(stage_n / stage_s) / (bare_n / bare_s):.2f}x")
    (b1, s1), (b2, s2) = results.values()
    bare_marginal = (b2[1] - b1[1]) / (b2[0] - b1[0])
    stage_marginal = (s2[1] - s1[1]) / (s2[0] - s1[0])
    print(f"  marginal: bare {bare_marginal:.2f} images/s, stage {stage_marginal:.2f} "
          f"images/s, ratio stage/bare = {stage_marginal / bare_marginal:.2f}x", flush=True)
