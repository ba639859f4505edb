"""The CLIP step inside stage 3 against a bare open_clip loop: same images, model, batch.

    python bench/clip.py [--images 160] [--batch-size 16] [--model ViT-B-32] [--threads 2]

- bare: one process, open_clip's model and preprocessing, decode + preprocess + encode
  image and text per batch, cosine similarity; timed from model creation to last score;
- stage: `run_process` with only the CLIP step (score_only), timed from the call (actor
  start, model load, reading shards, Ray Data streaming, writing shards included).
Both run on N and 2N images; see bench/stage_step.py for the whole-run and marginal
rates. Random weights: the compute does not depend on them. fp32 (bf16 is ~10x slower on
CPU).
"""

from __future__ import annotations

import time
from pathlib import Path

from common import arg_parser
from stage_step import (
    add_stage_args,
    compare,
    decode,
    pool_label,
    pool_section,
    raw_images,
)


def bare_loop(raw: Path, model_name: str, batch_size: int, threads: int) -> tuple[float, int]:
    import open_clip
    import torch

    torch.set_num_threads(threads)
    samples = raw_images(raw)
    start = time.perf_counter()
    model, _, preprocess = open_clip.create_model_and_transforms(model_name, pretrained=None)
    model.eval()
    tokenizer = open_clip.get_tokenizer(model_name)
    for i in range(0, len(samples), batch_size):
        batch = samples[i:i + batch_size]
        images = torch.stack([preprocess(decode(data)) for data, _ in batch])
        texts = tokenizer([caption for _, caption in batch])
        with torch.inference_mode():
            img = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(texts), dim=-1)
            (img * txt).sum(-1).numpy()
    return time.perf_counter() - start, len(samples)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", default="ViT-B-32")
    add_stage_args(parser)
    args = parser.parse_args()
    clip = {"enabled": True, "model": args.model, "pretrained": None, "mode": "score_only",
            "batch_size": args.batch_size, **pool_section(args)}
    compare(args.images,
            lambda raw: bare_loop(raw, args.model, args.batch_size, args.threads),
            {"clip": clip},
            f"CLIP {args.model} (random weights, fp32), batch {args.batch_size}; "
            f"{pool_label(args)}", multiples=args.multiples, repeats=args.repeats)


if __name__ == "__main__":
    main()
