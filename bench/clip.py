"""The CLIP step inside stage 3 against a bare open_clip loop: same images, model, batch.

    python bench/clip.py [--images 160] [--batch-size 16] [--model ViT-B-32] [--threads 2]

Raw shards of COCO sample photos are made once (stage 1 over loopback HTTP), then:
- bare: one process, open_clip's model and preprocessing, decode + preprocess + encode
  image and text per batch, cosine similarity; timed from model creation to last score;
- stage: `run_process` with only the CLIP step (score_only), timed from the call (actor
  start, model load, reading shards, Ray Data streaming, writing shards included).
Each runs on N and on 2N images. The whole-run rate includes fixed costs (the stage starts
a Ray worker that imports torch and open_clip, Ray Data's executor, the writers); the
marginal rate N / (t(2N) - t(N)) is the per-image throughput once running, which is
what a build of millions of images sees.
Random weights: the compute does not depend on them. fp32 (bf16 is ~10x slower on CPU).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COCO = ROOT.parent / "shared" / "data" / "coco-sample"
sys.path.insert(0, str(ROOT / "tests"))


def make_raw(out: Path, n: int) -> None:
    from loopback_server import LoopbackServer

    from pairforge.config import parse_config
    from pairforge.pipeline.runner import run_download

    with open(COCO / "captions.csv", newline="") as f:
        rows = [(r["filename"], r["caption"].strip()) for r in csv.DictReader(f)][:n]
    with LoopbackServer(COCO / "images") as server:
        lines = ["url,caption"] + [f"{server.url('/img/' + name)},\"{cap}\"" for name, cap in rows]
        (out.parent / "in.csv").write_text("\n".join(lines) + "\n")
        cfg = parse_config({"input": {"path": str(out.parent / "in.csv"), "shard_size": 40},
                            "output": {"path": str(out)},
                            "download": {"allow_addresses": ["127.0.0.1/32"],
                                         "image": {"image_size": 256}}})
        run_download(cfg, show_progress=False)


def bare_loop(raw: Path, model_name: str, batch_size: int, threads: int) -> tuple[float, int]:
    import open_clip
    import torch
    import webdataset as wds
    from PIL import Image

    torch.set_num_threads(threads)
    samples = list(wds.WebDataset(sorted(str(p) for p in raw.glob("*.tar")), shardshuffle=False))
    start = time.perf_counter()
    model, _, preprocess = open_clip.create_model_and_transforms(model_name, pretrained=None)
    model.eval()
    tokenizer = open_clip.get_tokenizer(model_name)
    for i in range(0, len(samples), batch_size):
        batch = samples[i:i + batch_size]
        images = torch.stack([preprocess(Image.open(io.BytesIO(s["jpg"])).convert("RGB"))
                              for s in batch])
        texts = tokenizer([s["txt"].decode() for s in batch])
        with torch.inference_mode():
            img = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(texts), dim=-1)
            (img * txt).sum(-1).numpy()
    return time.perf_counter() - start, len(samples)


def stage(out: Path, model_name: str, batch_size: int, threads: int) -> tuple[float, int]:
    from pairforge.config import parse_config
    from pairforge.pipeline.process import run_process

    cfg = parse_config({
        "input": {"path": "unused"}, "output": {"path": str(out)}, "dedup": {"enabled": False},
        "process": {"basic": {"enabled": False},
                    "clip": {"enabled": True, "model": model_name, "pretrained": None,
                             "mode": "score_only", "batch_size": batch_size,
                             "torch_threads": threads}}})
    start = time.perf_counter()
    summary = run_process(cfg, show_progress=False)
    return time.perf_counter() - start, summary["status"].get("ok", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (args.images, 2 * args.images):
            out = Path(tmp) / f"out{n}"
            make_raw(out, n)
            init_ray(RayConfig())  # started before either clock runs
            results[n] = (bare_loop(out / "raw", args.model, args.batch_size, args.threads),
                          stage(out, args.model, args.batch_size, args.threads))
    print(f"model={args.model} (random weights, fp32) batch={args.batch_size} "
          f"torch threads={args.threads}")
    for n, ((bare_s, bare_n), (stage_s, stage_n)) in results.items():
        print(f"{n:4d} images: bare {bare_s:6.1f} s = {bare_n / bare_s:5.2f} images/s, "
              f"stage {stage_s:6.1f} s = {stage_n / stage_s:5.2f} images/s, "
              f"ratio {(stage_n / stage_s) / (bare_n / bare_s):.2f}x")
    (b1, s1), (b2, s2) = results.values()
    bare_marginal = (b2[1] - b1[1]) / (b2[0] - b1[0])
    stage_marginal = (s2[1] - s1[1]) / (s2[0] - s1[0])
    print(f"marginal: bare {bare_marginal:.2f} images/s, stage {stage_marginal:.2f} images/s, "
          f"ratio stage/bare = {stage_marginal / bare_marginal:.2f}x")


if __name__ == "__main__":
    main()
