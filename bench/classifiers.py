"""Image classifiers in stage 3 (issue 21): the classifier step against a bare transformers
loop, and what a clip-head classifier adds to the CLIP step.

    python bench/classifiers.py [--images 48] [--batch-size 16] [--vit base] \
        [--threads 2] [--pool-size 2 --stage-threads 1] [--heads-only | --step-only] \
        [--repeats 2]

- step: a ViT image classifier (``--vit base``: the architecture of
  Falconsai/nsfw_image_detection, ViT-B/16 at 224 px; ``small``: ViT-S/16) with random
  weights (no hub; the compute does not depend on them), saved with save_pretrained and
  loaded by path. bare: one process, AutoImageProcessor + AutoModelForImageClassification,
  decode + preprocess + forward + softmax per batch, timed from model loading to the last
  score. stage: `run_process` with only the classifier step, timed from the call.
  Both run on N, 2N, 3N images; the steady-state ratio is what a long build sees
  (bench/stage_step.py).
- heads: the CLIP step alone (score_only) against the CLIP step plus a clip-head
  classifier (LAION's aesthetic-predictor layout over ViT-B-32's 512-dim embeddings), on
  the same raw shards; the manifest's per-step seconds show what each step costs per
  image. A head that encoded the images again would cost about as much as CLIP.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import arg_parser
from stage_step import (
    add_stage_args,
    cleared,
    compare,
    decode,
    make_raw,
    pool_label,
    pool_section,
    raw_images,
    stage_seconds,
)

VITS = {"base": {},  # ViTConfig's defaults are ViT-B/16 at 224 px
        "small": {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}}


def save_vit(folder: Path, size: str) -> str:
    """A random-weight ViT image classifier with labels normal / nsfw, saved by path."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(**VITS[size], id2label={0: "normal", 1: "nsfw"},
                       label2id={"normal": 0, "nsfw": 1})
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessor().save_pretrained(folder)
    return str(folder)


def bare_loop(raw: Path, model: str, batch_size: int, threads: int) -> tuple[float, int]:
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    torch.set_num_threads(threads)
    samples = raw_images(raw)
    start = time.perf_counter()
    processor = AutoImageProcessor.from_pretrained(model)
    net = AutoModelForImageClassification.from_pretrained(model).eval()
    for i in range(0, len(samples), batch_size):
        images = [decode(data) for data, _ in samples[i:i + batch_size]]
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            net(pixel_values=pixels).logits.float().softmax(-1)[:, 1].numpy()
    return time.perf_counter() - start, len(samples)


def step_vs_bare(args: argparse.Namespace, model: str) -> None:
    entry = {"name": "nsfw", "backend": "transformers", "model": model, "label": "nsfw",
             "batch_size": args.batch_size, **pool_section(args)}
    label = (f"classifier step, ViT-{args.vit}/16 224 px (random weights, fp32), batch "
             f"{args.batch_size}; {pool_label(args)}")
    bare = lambda raw: bare_loop(raw, model, args.batch_size, args.threads)  # noqa: E731
    compare(args.images, bare, {"classifiers": [entry]}, label,
            multiples=args.multiples, repeats=args.repeats)


def save_aesthetic_head(path: Path, dim: int) -> None:
    """LAION's improved aesthetic predictor layout (layers.0 ... layers.7), random weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                           nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1),
                           nn.Linear(64, 16), nn.Linear(16, 1))
    torch.save({f"layers.{k}": v for k, v in layers.state_dict().items()}, path)


def heads(args: argparse.Namespace, folder: Path) -> None:
    """CLIP alone vs CLIP + a clip-head classifier: whole-run seconds and per-step seconds
    per image from the manifest (best of --repeats)."""
    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    head = folder / "aesthetic.pth"
    save_aesthetic_head(head, 512)
    n = args.images * args.multiples
    out = folder / f"heads{n}"
    make_raw(out, n)
    clip = {"enabled": True, "model": "ViT-B-32", "pretrained": None, "mode": "score_only",
            "batch_size": args.batch_size, **pool_section(args)}
    aesthetic = {"name": "aesthetic", "backend": "clip-head", "path": str(head),
                 "batch_size": args.batch_size, "pool_size": 1, "num_cpus": 0.1}
    init_ray(RayConfig())
    stage_seconds(cleared(out), {"clip": clip})  # warm-up: workers have imported torch
    print(f"clip-head: ViT-B-32 CLIP (random weights, fp32), {n} images, batch "
          f"{args.batch_size}; {pool_label(args)}")
    for label, process in (("CLIP only", {"clip": clip}),
                           ("CLIP + aesthetic head", {"clip": clip,
                                                      "classifiers": [aesthetic]})):
        best = min((_run(out, process) for _ in range(args.repeats)), key=lambda r: r[0])
        seconds, ok, steps = best
        per_step = ", ".join(f"{name} {s['seconds'] / max(s['rows_in'], 1) * 1e3:.2f} ms"
                             for name, s in steps.items() if name != "caption")
        print(f"  {label:22s}: {seconds:6.1f} s = {ok / seconds:6.2f} images/s; per image "
              f"in process(): {per_step}", flush=True)


def _run(out: Path, process: dict) -> tuple[float, int, dict]:
    seconds, ok = stage_seconds(cleared(out), process)
    steps = json.loads((out / "manifest.json").read_text())["steps"]
    return seconds, ok, steps


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vit", choices=sorted(VITS), default="base")
    parser.add_argument("--heads-only", action="store_true")
    parser.add_argument("--step-only", action="store_true")
    parser.add_argument("--interleave", action="store_true",
                        help="(always so now: bench/stage_step.compare alternates the runs; "
                        "kept so the commands recorded in RESULTS.md run)")
    add_stage_args(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.heads_only:
            step_vs_bare(args, save_vit(Path(tmp) / "vit", args.vit))
        if not args.step_only:
            heads(args, Path(tmp))


if __name__ == "__main__":
    main()
