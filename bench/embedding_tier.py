"""The recaption cache's embedding tier with the captioner's own encoder: what a lookup
costs next to the caption it can save (issue 20).

    python bench/embedding_tier.py [--arch blip] [--resolution 384] [--images 16]
                                   [--batch 8] [--max-new-tokens 30] [--rounds 3] [--threads 1]

The base architecture (BLIP-base or GIT-base, random weights built from transformers'
configs: the compute does not depend on the weights) is loaded through the step's own
backend (``TransformersCaptioner``). In interleaved rounds over the same COCO photos from
../shared/data: ``image_embeddings`` (the tier's vector: the vision tower alone) against
``generate`` (encoder, prefill and ``--max-new-tokens`` greedy tokens; random weights emit
no end token, so every caption is that long) against the two in a row, as a miss runs them
(``generate`` then reads the tower's outputs from the memo, recaption/vision.py). Every row
the exact and perceptual tiers miss pays the lookup; a hit saves the rest.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from PIL import Image

from pairforge.config import RecaptionConfig
from pairforge.recaption.backends import TransformersCaptioner
from pairforge.recaption.tiny import save_tiny_captioner

COCO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "coco-sample"


def _seconds(call, images: list[Image.Image], batch: int) -> float:  # noqa: ANN001
    start = time.process_time()
    for i in range(0, len(images), batch):
        call(images[i:i + batch])
    return (time.process_time() - start) / len(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["blip", "git"], default="blip")
    parser.add_argument("--resolution", type=int, default=384)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    photos = [Image.open(p).convert("RGB")
              for p in sorted((COCO / "images").glob("*.jpg"))[:args.images]]
    captions = [line.split(",", 1)[-1] for line in
                (COCO / "captions.csv").read_text().splitlines()[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_captioner(args.arch, Path(tmp) / args.arch, captions,
                                     resolution=args.resolution, size="base")
        captioner = TransformersCaptioner(RecaptionConfig(
            enabled=True, model=str(folder), max_new_tokens=args.max_new_tokens,
            prompt_mode="none"))
        memo = captioner.vision.memo

        def caption(images: list[Image.Image]) -> None:
            memo.rows.clear()  # no lookup before: the tower runs
            captioner.generate(images, "")

        def miss(images: list[Image.Image]) -> None:
            captioner.image_embeddings(images)  # generate reads the tower's outputs
            captioner.generate(images, "")

        embed, generate, missed = [], [], []
        miss(photos[:2])  # warm up
        for _ in range(args.rounds):
            embed.append(_seconds(captioner.image_embeddings, photos, args.batch))
            generate.append(_seconds(caption, photos, args.batch))
            missed.append(_seconds(miss, photos, args.batch))
    e, g, m = (statistics.median(x) for x in (embed, generate, missed))
    params = sum(p.numel() for p in captioner.model.parameters()) / 1e6
    print(f"{args.arch}-base at {args.resolution} px ({params:.0f} M parameters), "
          f"{args.images} photos, batches of {args.batch}, {args.threads} thread(s), "
          f"CPU seconds per image, median of {args.rounds} interleaved rounds")
    print(f"  image_embeddings (the tier's lookup vector): {e:.4f}  rounds {embed}")
    print(f"  generate, {args.max_new_tokens} new tokens:  {g:.4f}  rounds {generate}")
    print(f"  lookup, then generate (a miss):  {m:.4f}  rounds {missed}")
    print(f"  a hit costs {e / g:.1%} of a caption (saves {1 - e / g:.1%}); a miss "
          f"{m / g:.1%}; at hit rate h a row the hash tiers miss costs "
          f"{e / g:.3f} h + {m / g:.3f} (1 - h) captions")


if __name__ == "__main__":
    main()
