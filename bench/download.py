"""Stage 1 against img2dataset: same loopback server, same input, same resize, same workers.

    python bench/download.py [--rows 10000] [--processes 2] [--threads 32]

The input is the real alt-text of ../shared/data/alttext-10k.parquet with each URL
rewritten to one of the COCO sample photos served over loopback HTTP. img2dataset runs
from its own virtual environment (it pins an older webdataset), made on first use in
bench/.venv-img2dataset.
pairforge computes sha256, the pixel hash and the perceptual hash; img2dataset sha256 only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
I2D_VENV = ROOT / "bench" / ".venv-img2dataset"
I2D_PYTHON = I2D_VENV / "bin" / "python"
I2D_VERSION = "img2dataset==1.47.0"


def ensure_img2dataset() -> None:
    if not I2D_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(I2D_VENV)], check=True)
        subprocess.run([str(I2D_PYTHON), "-m", "pip", "install", "-q", I2D_VERSION], check=True)


def _serve(root: str, port_queue: mp.Queue) -> None:
    from pairforge.pipeline.sample_server import serve_directory

    with serve_directory(root) as url:
        port_queue.put(url)
        while True:
            time.sleep(3600)


def start_server(root: Path) -> tuple[mp.Process, str]:
    """The image host runs in its own process so neither tool's driver shares its GIL."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(str(root), queue), daemon=True)
    proc.start()
    return proc, queue.get(timeout=30)


def make_input(base_url: str, rows: int, path: Path) -> None:
    alt = pq.read_table(DATA / "alttext-10k.parquet", columns=["URL", "TEXT"])
    images = sorted(p.name for p in (DATA / "coco-sample" / "images").glob("*.jpg"))
    reps = -(-rows // alt.num_rows)
    captions = (alt["TEXT"].to_pylist() * reps)[:rows]
    urls = [f"{base_url}/{images[i % len(images)]}" for i in range(rows)]
    pq.write_table(pa.table({"URL": urls, "TEXT": captions}), path)


def run_img2dataset(inp: Path, out: Path, args: argparse.Namespace) -> float:
    cmd = [str(I2D_PYTHON), "-m", "img2dataset.main", "--url_list", str(inp),
           "--input_format", "parquet", "--url_col", "URL", "--caption_col", "TEXT",
           "--output_format", "webdataset", "--output_folder", str(out),
           "--processes_count", str(args.processes), "--thread_count", str(args.threads),
           "--number_sample_per_shard", str(args.shard_size),
           "--image_size", str(args.image_size), "--resize_mode", "keep_ratio",
           "--encode_format", "jpg", "--encode_quality", "95", "--timeout", "10",
           "--retries", "0", "--distributor", "multiprocessing", "--enable_wandb", "False"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def count_img2dataset(out: Path) -> int:
    return sum(json.loads(p.read_text())["successes"] for p in out.glob("*_stats.json"))


def run_pairforge(inp: Path, out: Path, args: argparse.Namespace) -> tuple[float, float, int]:
    """(seconds to start Ray, seconds of the download stage, ok images), in this process."""
    from pairforge.config import load_config
    from pairforge.pipeline.ray_runtime import init_ray, shutdown_ray
    from pairforge.pipeline.runner import run_download

    cfg = load_config(ROOT / "bench" / "dl.yaml", [
        f"input.path={inp}", f"output.path={out}", f"input.shard_size={args.shard_size}",
        f"download.processes={args.processes}", f"download.threads={args.threads}",
        f"download.image.image_size={args.image_size}", f"ray.num_cpus={args.processes}"])
    start = time.perf_counter()
    init_ray(cfg.ray)
    ray_s = time.perf_counter() - start
    start = time.perf_counter()
    summary = run_download(cfg, show_progress=False)
    stage_s = time.perf_counter() - start
    shutdown_ray()
    return ray_s, stage_s, summary["status"].get("ok", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--image-size", type=int, default=256)
    args = parser.parse_args()
    ensure_img2dataset()
    server, base_url = start_server(DATA / "coco-sample" / "images")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp = Path(tmp) / "input.parquet"
            make_input(base_url, args.rows, inp)
            i2d_s = run_img2dataset(inp, Path(tmp) / "i2d", args)
            i2d_ok = count_img2dataset(Path(tmp) / "i2d")
            ray_s, pf_s, pf_ok = run_pairforge(inp, Path(tmp) / "pf", args)
    finally:
        server.terminate()
    i2d_rate, pf_rate, pf_cold = i2d_ok / i2d_s, pf_ok / pf_s, pf_ok / (pf_s + ray_s)
    print(f"rows={args.rows} processes={args.processes} threads={args.threads} "
          f"resize=keep_ratio {args.image_size} jpg")
    print(f"img2dataset           : {i2d_ok:6d} ok in {i2d_s:6.2f} s = {i2d_rate:7.1f} images/s"
          " (whole command, process pool start included)")
    print(f"pairforge, Ray up     : {pf_ok:6d} ok in {pf_s:6.2f} s = {pf_rate:7.1f} images/s"
          " (+ pixel hash + phash; task start included)")
    print(f"pairforge + Ray start : {pf_ok:6d} ok in {pf_s + ray_s:6.2f} s = {pf_cold:7.1f} "
          f"images/s (local Ray took {ray_s:.1f} s to start)")
    print(f"ratio pairforge/img2dataset = {pf_rate / i2d_rate:.2f}x with Ray up, "
          f"{pf_cold / i2d_rate:.2f}x counting Ray's start")


if __name__ == "__main__":
    main()
