"""A model step inside stage 3 against a bare loop: the harness of bench/clip.py, vq.py,
recaption.py and classifiers.py.

Raw shards of COCO sample photos are made with stage 1 (loopback HTTP). Each side runs on
N and on 2N images. The whole-run rate includes fixed costs (the stage starts a Ray worker
that imports torch and loads the model, Ray Data's executor, the writers); the marginal
rate N / (t(2N) - t(N)) is the per-image throughput once running, which is what a build of
millions of images sees. Both sides make one unmeasured warm-up run first; then the bare
and stage runs alternate, and each run's CPU seconds are measured beside its wall time
(the stage's over its whole process tree), the figure a loaded host moves least.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import COCO, TESTS, TreeSampler

sys.path.insert(0, str(TESTS))  # loopback_server: the tests' image host


def make_raw(out: Path, n: int, image_size: int = 256, shard_size: int = 1000,
             unique: int | None = None) -> None:
    """Stage-1 raw shards of n COCO sample photos: the first ``unique`` (default n) photos,
    listed again from the start (same URL, same pixels) until there are n rows."""
    from loopback_server import LoopbackServer

    from pairforge.config import parse_config
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

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
        run_download(cfg, RunOptions(show_progress=False))


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
    from pairforge.pipeline.entry import RunOptions
    from pairforge.pipeline.process import run_process

    cfg = parse_config({"input": {"path": "unused"}, "output": {"path": str(out)},
                        "dedup": {"enabled": False},
                        "process": {"basic": {"enabled": False}, **process}})
    start = time.perf_counter()
    summary = run_process(cfg, RunOptions(show_progress=False))
    return time.perf_counter() - start, summary["status"].get("ok", 0)


WARMUP = 40


def add_stage_args(parser: Any) -> None:
    """The bare loop's torch threads, the stage's actor pool, and how often to measure."""
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the bare loop")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size; the best counts")
    add_pool_args(parser)


def add_pool_args(parser: Any) -> None:
    """The stage's actor pool and the sizes to measure (the rest of ``add_stage_args``)."""
    parser.add_argument("--pool-size", type=int, default=1, help="actors of the stage's pool")
    parser.add_argument("--stage-threads", type=int, default=None,
                        help="torch threads per actor (default: --threads)")
    parser.add_argument("--multiples", type=int, default=3,
                        help="measure on N, 2N, .. this many times N images")


def pool_section(args: Any) -> dict[str, int]:
    """The model step's pool settings from ``add_pool_args``."""
    return {"pool_size": args.pool_size, "torch_threads": args.stage_threads or args.threads}


def pool_label(args: Any) -> str:
    pool = pool_section(args)
    return (f"bare: {args.threads} torch threads; stage: {pool['pool_size']} actor(s) x "
            f"{pool['torch_threads']} threads")


def compare(n: int, bare: Callable[[Path], tuple[float, int]], process: dict[str, Any],
            label: str, multiples: int = 3, repeats: int = 1) -> None:
    """Print whole-run images/s of the bare loop and the stage on n, 2n, .. multiples*n
    images (best of ``repeats``), the steady-state rate of each (the inverse slope of a
    least-squares line through seconds against images, whose intercept is the fixed
    cost), the same for CPU seconds, and the seconds per image inside each step's
    ``process()``. The bare and stage runs alternate (bare, stage, bare, stage ...): on a
    machine whose load from other users drifts over minutes, both sides see the same load.
    CPU seconds: the bare loop's process, and for the stage this process and every one
    under it (Ray's daemons, workers and actors): a loaded host stretches wall time, CPU
    time much less."""
    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    sizes = [n * k for k in range(1, multiples + 1)]
    runs: dict[str, dict[int, list[tuple[float, int, float]]]] = {
        "bare": {s: [] for s in sizes}, "stage": {s: [] for s in sizes}}
    with tempfile.TemporaryDirectory() as tmp:
        warmup = min(WARMUP, n // 2)  # a few images warm up; slow models take fewer
        outs = {size: Path(tmp) / f"out{size}" for size in (warmup, *sizes)}
        for size, out in outs.items():
            make_raw(out, size)
        init_ray(RayConfig())  # started before any clock runs
        # A first, unmeasured run on a few images, on both sides, so that both measured
        # runs start alike (Ray's worker processes have imported torch; caches are warm).
        warm = outs.pop(warmup)
        bare(warm / "raw")
        stage_seconds(warm, process)
        for _ in range(repeats):
            for size, out in outs.items():
                runs["bare"][size].append(_with_cpu(lambda o=out: bare(o / "raw")))
                runs["stage"][size].append(
                    _with_cpu(lambda o=out: stage_seconds(cleared(o), process)))
        steps = json.loads((outs[sizes[-1]] / "manifest.json").read_text())["steps"]
    _report(label, sizes, runs, repeats, steps)


def _with_cpu(run: Callable[[], tuple[float, int]]) -> tuple[float, int, float]:
    """(seconds, images, CPU seconds this process and all its descendants spent)."""
    with TreeSampler(os.getpid(), 0.25) as sampler:  # reading /proc costs CPU too
        before = {pid: proc.cpu_s for pid, proc in sampler.procs.items()}
        seconds, images = run()
        sampler.sample()
    return seconds, images, sum(p.cpu_s - before.get(pid, 0.0)
                                for pid, p in sampler.procs.items())


def _report(label: str, sizes: list[int], runs: dict, repeats: int, steps: dict) -> None:
    print(f"{label} (bare and stage runs interleaved; load {os.getloadavg()[0]:.1f})")
    # the fastest run of each (other work only ever slows one), and the least CPU
    best = {side: {s: min(r[s]) for s in sizes} for side, r in runs.items()}
    cpu = {side: {s: min(run[2] for run in r[s]) for s in sizes} for side, r in runs.items()}
    for size in sizes:
        (bare_s, bare_n, _), (stage_s, stage_n, _) = best["bare"][size], best["stage"][size]
        print(f"  {size:5d} images: bare {bare_s:6.1f} s = {bare_n / bare_s:7.2f} images/s, "
              f"stage {stage_s:6.1f} s = {stage_n / stage_s:7.2f} images/s, "
              f"ratio {(stage_n / stage_s) / (bare_n / bare_s):.2f}x; CPU bare "
              f"{cpu['bare'][size]:6.1f} s, stage {cpu['stage'][size]:6.1f} s")
    (bare_rate, bare_fixed), (stage_rate, stage_fixed) = (
        _fit([best[side][s][:2] for s in sizes]) for side in ("bare", "stage"))
    print(f"  steady state (fit over {len(sizes)} sizes, best of {repeats}): bare "
          f"{bare_rate:.2f} images/s + {bare_fixed:.1f} s fixed, stage {stage_rate:.2f} "
          f"images/s + {stage_fixed:.1f} s fixed; ratio stage/bare = "
          f"{stage_rate / bare_rate:.2f}x")
    rates = {side: _fit([(cpu[side][s], s) for s in sizes])[0] for side in cpu}
    print(f"  CPU per image (fit, least of {repeats}): bare {1e3 / rates['bare']:.0f} ms "
          f"(this process), stage {1e3 / rates['stage']:.0f} ms (driver, Ray and every "
          f"worker and actor); ratio bare/stage = {rates['stage'] / rates['bare']:.2f}x")
    for name, step in steps.items():
        if step.get("rows_in"):
            print(f"  inside {name}'s process() at {sizes[-1]} images (last run): "
                  f"{step['seconds'] / step['rows_in'] * 1e3:.1f} ms per image per actor",
                  flush=True)


def cleared(out: Path) -> Path:
    """``out`` without a previous stage-3 run's output, so the stage redoes every shard."""
    import shutil

    for path in out.iterdir():
        if path.is_dir() and path.name != "raw":
            shutil.rmtree(path)
        elif path.is_file():
            path.unlink()
    return out


def _fit(runs: list[tuple[float, int]]) -> tuple[float, float]:
    """(images per second, fixed seconds) of the line seconds = fixed + images / rate."""
    import numpy as np

    seconds, images = np.array([r[0] for r in runs]), np.array([r[1] for r in runs])
    slope, intercept = np.polyfit(images, seconds, 1)
    return 1.0 / slope, float(intercept)
