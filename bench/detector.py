"""Grounding by a detector: what it costs per image (issue 20).

    python bench/detector.py [--images 32] [--nouns 3] [--batch 8] [--base-seconds] [--tiny-only]
                              [--threads 1]

1. The tiny random-weight OWL-ViT of the tests (pairforge.recaption.tiny), timed through
   the backend (DetectorGrounding.scores: processor, forward, best box per query) on CPU
   photos from ../shared/data, ``--nouns`` queries per image: seconds per image.
2. The published architectures, built from transformers' default configs with random
   weights (nothing downloaded): FLOPs of one forward per image (torch's FlopCounterMode
   over a CPU forward), for OWL-ViT B/32 at 768 px
   (google/owlvit-base-patch32) and OWLv2 B/16 at 960 px
   (google/owlv2-base-patch16-ensemble), image tower and text queries apart.
3. ``--base-seconds``: also one CPU forward of each base architecture (random weights),
   timed, on this machine.

No checkpoint is read (model hubs are unreachable here): the FLOPs are the architecture's,
which the checkpoint's weights do not change; a device time from them needs a utilisation
assumption, printed as such.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from PIL import Image

from pairforge.config import GroundingConfig
from pairforge.recaption.grounding import load_grounding
from pairforge.recaption.tiny import save_tiny_detector

COCO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "coco-sample" / "images"
NOUNS = ["dog", "cat", "bench", "bus", "pizza", "person", "car", "table"]
QUERIES = 3


def tiny_seconds(n_images: int, n_nouns: int, batch: int) -> tuple[float, float]:
    """(seconds per image through DetectorGrounding.scores, of which the processor)."""
    photos = [Image.open(p).convert("RGB") for p in sorted(COCO.glob("*.jpg"))[:n_images]]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_detector(Path(tmp) / "owl", [f"a photo of a {n}" for n in NOUNS])
        grounding = load_grounding(GroundingConfig(backend="detector",
                                                   detector={"model": str(folder)}),
                                   "cpu", clip=lambda: None)
        nouns = [[NOUNS[(i + k) % len(NOUNS)] for k in range(n_nouns)]
                 for i in range(len(photos))]
        grounding.scores(photos[:batch], nouns[:batch], [None] * batch)  # warm up
        start = time.perf_counter()
        for i in range(0, len(photos), batch):
            grounding.scores(photos[i:i + batch], nouns[i:i + batch], [None] * batch)
        total = (time.perf_counter() - start) / len(photos)
        start = time.perf_counter()
        for i in range(0, len(photos), batch):
            grounding.processor(text=[[f"a photo of a {n}" for n in ns]
                                      for ns in nouns[i:i + batch]],
                                images=photos[i:i + batch], return_tensors="pt",
                                truncation=True)
        return total, (time.perf_counter() - start) / len(photos)


def _model(kind: str, device: str, attention: str = "sdpa"):  # noqa: ANN202
    """The base architecture with random weights, and its input side."""
    import torch
    from transformers import (
        Owlv2Config,
        Owlv2ForObjectDetection,
        OwlViTConfig,
        OwlViTForObjectDetection,
    )

    with torch.device(device):
        if kind == "owlv2":
            config = Owlv2Config(vision_config={"image_size": 960, "patch_size": 16})
            return Owlv2ForObjectDetection._from_config(
                config, attn_implementation=attention).eval(), 960
        config = OwlViTConfig(vision_config={"image_size": 768, "patch_size": 32})
        return OwlViTForObjectDetection._from_config(
            config, attn_implementation=attention).eval(), 768


def _inputs(side: int, queries: int, device: str) -> dict:
    import torch

    ids = torch.randint(1, 1000, (queries, 16), device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.rand(1, 3, side, side, device=device)}


def flops(kind: str, queries: int = QUERIES) -> dict[str, float]:
    """GFLOPs of one image with ``queries`` text queries, and of the image tower alone
    (torch's FlopCounterMode over one CPU forward with eager attention, whose matmuls it
    counts, where it misses CPU SDPA kernels; the meta device cannot run the text tower's
    mask)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model, side = _model(kind, "cpu", "eager")
    inputs = _inputs(side, queries, "cpu")
    total, image = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with total, torch.inference_mode():
        model(**inputs)
    with image, torch.inference_mode():
        model.image_embedder(pixel_values=inputs["pixel_values"])
    return {"total": total.get_total_flops() / 1e9, "image": image.get_total_flops() / 1e9}


def base_seconds(kind: str, queries: int = QUERIES) -> float:
    """One CPU forward of the base architecture (random weights), after a warm-up."""
    import torch

    model, side = _model(kind, "cpu")
    inputs = _inputs(side, queries, "cpu")
    with torch.inference_mode():
        model(**inputs)
        start = time.perf_counter()
        model(**inputs)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--nouns", type=int, default=QUERIES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--base-seconds", action="store_true")
    parser.add_argument("--tiny-only", action="store_true", help="skip the base models")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: what Ray "
                        "gives a fractional-CPU actor; on a loaded machine 2 threads made "
                        "the tiny model 50x slower)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}")
    seconds, processor = tiny_seconds(args.images, args.nouns, args.batch)
    print(f"tiny OWL-ViT (32 px, 2 layers, 32 wide), {args.nouns} queries per image, "
          f"batches of {args.batch}, CPU: {seconds * 1000:.2f} ms per image, of which the "
          f"processor (resize, normalise, tokenize) {processor * 1000:.2f} ms")
    if args.tiny_only:
        return
    for kind, name in (("owlvit", "google/owlvit-base-patch32 (768 px)"),
                       ("owlv2", "google/owlv2-base-patch16-ensemble (960 px)")):
        f = flops(kind, args.nouns)
        line = (f"{name}: {f['total']:.1f} GFLOPs per image with {args.nouns} queries "
                f"(image tower {f['image']:.1f})")
        if args.base_seconds:
            line += f"; one CPU forward here: {base_seconds(kind, args.nouns):.2f} s"
        print(line)


if __name__ == "__main__":
    main()
