"""Grounding by a detector: what it costs per image (issue 20).

    python bench/detector.py [--images 32] [--nouns 3] [--batch 8] [--base-seconds] [--tiny-only]
                              [--threads 1]
    python bench/detector.py --device cuda [--images 64] [--batch 16] [--rounds 2]
                              [--kinds owlvit,owlv2] [--photos tests/data/coco/images]

1. The tiny random-weight OWL-ViT of the tests (tests/tiny_detector.py), timed through
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
which the checkpoint's weights do not change.

``--device cuda`` (a GPU machine) measures instead, for both base architectures saved as
checkpoint folders (random weights; the real image processor; a CLIP tokenizer trained
on the queries, so a small text vocabulary, whose embedding lookup costs the same):

4. ``DetectorGrounding.scores`` as stage 3 calls it (processor on the CPU, forward in the
   section's ``auto`` dtype, bf16 on a GPU, best box per query), batches of ``--batch``
   photos with ``--nouns`` queries each: ms per image.
5. The bare model: the same batches already processed and on the device, forwards alone
   (CUDA-synchronised): ms per image, the GPU's share.
6. The processor alone on the same batches: the CPU's share, on that machine's CPU.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import COCO_IMAGES, TESTS, arg_parser
from PIL import Image

sys.path.insert(0, str(TESTS))
from tiny_detector import clip_tokenizer, save_tiny_detector  # noqa: E402

from pairforge.config import GroundingConfig
from pairforge.recaption.checked import load_grounding

BASES = (("owlvit", "google/owlvit-base-patch32 (768 px)"),
         ("owlv2", "google/owlv2-base-patch16-ensemble (960 px)"))
NOUNS = ["dog", "cat", "bench", "bus", "pizza", "person", "car", "table"]
QUERIES = 3


def load_photos(folder: Path, n: int) -> list[Image.Image]:
    """``n`` photos of ``folder``, used again in turn when it holds fewer."""
    photos = [Image.open(p).convert("RGB") for p in sorted(folder.glob("*.jpg"))[:n]]
    return [photos[i % len(photos)] for i in range(n)]


def queries_of(n_images: int, n_nouns: int) -> list[list[str]]:
    return [[NOUNS[(i + k) % len(NOUNS)] for k in range(n_nouns)] for i in range(n_images)]


def tiny_seconds(n_images: int, n_nouns: int, batch: int) -> tuple[float, float]:
    """(seconds per image through DetectorGrounding.scores, of which the processor)."""
    photos = load_photos(COCO_IMAGES, n_images)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_detector(Path(tmp) / "owl", [f"a photo of a {n}" for n in NOUNS])
        grounding = load_grounding(GroundingConfig(backend="detector",
                                                   detector={"model": str(folder)}),
                                   "cpu", clip=lambda: None)
        nouns = queries_of(len(photos), n_nouns)
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


def save_base_detector(kind: str, out: Path) -> Path:
    """The base architecture (random weights) with its real image processor and a CLIP
    tokenizer trained on the queries, saved as a checkpoint folder."""
    from transformers import (
        Owlv2Config,
        Owlv2ForObjectDetection,
        Owlv2ImageProcessor,
        Owlv2Processor,
        OwlViTConfig,
        OwlViTForObjectDetection,
        OwlViTImageProcessor,
        OwlViTProcessor,
    )

    tokenizer = clip_tokenizer([f"a photo of a {n}" for n in NOUNS])
    text = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if kind == "owlv2":
        model = Owlv2ForObjectDetection(Owlv2Config(
            text_config=text, vision_config={"image_size": 960, "patch_size": 16}))
        processor = Owlv2Processor(image_processor=Owlv2ImageProcessor(), tokenizer=tokenizer)
    else:
        side = {"height": 768, "width": 768}
        model = OwlViTForObjectDetection(OwlViTConfig(
            text_config=text, vision_config={"image_size": 768, "patch_size": 32}))
        processor = OwlViTProcessor(image_processor=OwlViTImageProcessor(
            size=side, crop_size=side), tokenizer=tokenizer)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def device_rates(kind: str, device: str, photos: list[Image.Image], n_nouns: int,
                 batch: int, rounds: int = 3) -> dict[str, Any]:
    """ms per image: the stage's scores(), the bare forward (inputs on the device), and
    the processor alone; each the best of ``rounds`` passes over ``photos``."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_base_detector(kind, Path(tmp) / kind)
        grounding = load_grounding(GroundingConfig(backend="detector",
                                                   detector={"model": str(folder)}),
                                   device, clip=lambda: None)
    nouns = queries_of(len(photos), n_nouns)
    chunks = [(photos[i:i + batch], nouns[i:i + batch]) for i in range(0, len(photos), batch)]

    def processed(images: list, names: list) -> Any:
        return grounding.processor(text=[[f"a photo of a {n}" for n in ns] for ns in names],
                                   images=images, return_tensors="pt", truncation=True)

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def best(run: Callable[[], None]) -> float:
        run()  # warm-up: kernels, the allocator, cuDNN's choices
        times = []
        for _ in range(rounds):
            sync()
            start = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3 / len(photos)

    ready = [processed(images, names).to(device) for images, names in chunks]
    for inputs in ready:
        inputs["pixel_values"] = inputs["pixel_values"].to(grounding.model.dtype)

    def bare() -> None:
        with torch.inference_mode():
            for inputs in ready:
                grounding.model(**inputs).logits.float().amax(dim=1).cpu()

    return {"scores": best(lambda: [grounding.scores(im, ns, [None] * len(im))
                                    for im, ns in chunks]),
            "bare_forward": best(bare),
            "processor": best(lambda: [processed(im, ns) for im, ns in chunks]),
            "dtype": str(grounding.model.dtype)}


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--nouns", type=int, default=QUERIES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--base-seconds", action="store_true")
    parser.add_argument("--tiny-only", action="store_true", help="skip the base models")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: what Ray "
                        "gives a fractional-CPU actor; on a loaded machine 2 threads made "
                        "the tiny model 50x slower)")
    parser.add_argument("--device", default="cpu",
                        help="cuda: measure the base architectures on the GPU (4.-6.)")
    parser.add_argument("--photos", type=Path, default=COCO_IMAGES, help="photos for --device")
    parser.add_argument("--kinds", default="owlvit,owlv2", help="base models for --device")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes for --device")
    args = parser.parse_args()
    import torch

    if args.device != "cpu" or args.kinds != "owlvit,owlv2":
        where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
        print(f"{where}, torch {torch.__version__}; {args.images} photos, batches of "
              f"{args.batch}, {args.nouns} queries each", flush=True)
        photos = load_photos(args.photos, args.images)
        for kind, name in BASES:
            if kind not in args.kinds.split(","):
                continue
            r = device_rates(kind, args.device, photos, args.nouns, args.batch, args.rounds)
            print(f"{name}, {r['dtype']}: scores() {r['scores']:.3f} ms per image; bare "
                  f"forward {r['bare_forward']:.3f}; processor {r['processor']:.3f}",
                  flush=True)
        return
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}")
    seconds, processor = tiny_seconds(args.images, args.nouns, args.batch)
    print(f"tiny OWL-ViT (32 px, 2 layers, 32 wide), {args.nouns} queries per image, "
          f"batches of {args.batch}, CPU: {seconds * 1000:.2f} ms per image, of which the "
          f"processor (resize, normalise, tokenize) {processor * 1000:.2f} ms")
    if args.tiny_only:
        return
    for kind, name in BASES:
        f = flops(kind, args.nouns)
        line = (f"{name}: {f['total']:.1f} GFLOPs per image with {args.nouns} queries "
                f"(image tower {f['image']:.1f})")
        if args.base_seconds:
            line += f"; one CPU forward here: {base_seconds(kind, args.nouns):.2f} s"
        print(line)


if __name__ == "__main__":
    main()
