"""The recaption step inside stage 3 against a bare ``generate`` loop, and the cache.

    python bench/recaption.py [--images 48] [--batch-size 8] [--arch git] [--size tiny]
                              [--resolution 32] [--max-new-tokens 20] [--threads 2]

- bare: one process; ``AutoProcessor`` + ``AutoModelForImageTextToText`` loaded from the
  same folder, then for each batch: decode the JPEGs, the processor, greedy ``generate``
  and ``batch_decode``; timed from model loading to the last caption;
- stage: ``run_process`` with only the recaption step (cache, claim registry and the safety
  checks on; grounding off, as it needs a CLIP model), timed from the call. Captions the
  checks send back for a second try cost the stage extra generations (printed).
Both run on N and 2N images (bench/stage_step.py: whole-run and marginal rates).
Then the cache: a build of N rows of which a quarter repeat earlier photos (dedup off, so
the repeats reach the step), and a second build over the same rows sharing the cache.
Random weights (``size=base`` builds the GIT-base / BLIP-base architectures): the compute
does not depend on them.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

from common import COCO, TESTS, arg_parser
from stage_step import (
    add_stage_args,
    compare,
    decode,
    make_raw,
    pool_label,
    pool_section,
    raw_images,
    stage_seconds,
)

sys.path.insert(0, str(TESTS))  # tiny_models: the tests' random-weight captioners


def bare_loop(raw: Path, model_dir: Path, batch_size: int, max_new_tokens: int,
              threads: int) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(threads)
    samples = raw_images(raw)
    start = time.perf_counter()
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    for i in range(0, len(samples), batch_size):
        images = [decode(data) for data, _ in samples[i:i + batch_size]]
        inputs = processor(images=images, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        processor.batch_decode(out, skip_special_tokens=True)
    return time.perf_counter() - start, len(samples)


def recaption_section(model_dir: Path, args: argparse.Namespace, **extra: object) -> dict:
    return {"recaption": {"enabled": True, "model": str(model_dir),
                          "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                          **pool_section(args),
                          "grounding": {"enabled": False}, **extra}}


def cache_run(n: int, model_dir: Path, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        unique = n * 3 // 4
        first, second, cache = Path(tmp) / "first", Path(tmp) / "second", Path(tmp) / "cache"
        make_raw(first, n, unique=unique)
        make_raw(second, n, unique=unique)
        for label, out in (("first build", first), ("second build", second)):
            process = recaption_section(model_dir, args, cache={"path": str(cache)})
            seconds, ok = stage_seconds(out, process)
            stats = json.loads((out / "manifest.json").read_text())["recaption"]
            origin = stats["origin"]
            hits = ok - origin.get("model", 0)
            print(f"  {label}: {ok} rows ({unique} distinct photos) in {seconds:.1f} s; "
                  f"origins {origin}; model ran on {origin.get('model', 0)} images; "
                  f"hit rate {hits / ok:.2f}; regenerated {stats['regenerated']}", flush=True)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--arch", choices=["git", "blip"], default="git")
    parser.add_argument("--size", choices=["tiny", "base"], default="tiny")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    add_stage_args(parser)
    args = parser.parse_args()
    from tiny_models import save_tiny_captioner

    with open(COCO / "captions.csv", newline="") as f:
        captions = [r["caption"] for r in csv.DictReader(f)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_captioner(args.arch, Path(tmp) / "model", captions,
                                        resolution=args.resolution, size=args.size)
        compare(args.images,
                lambda raw: bare_loop(raw, model_dir, args.batch_size, args.max_new_tokens,
                                      args.threads),
                recaption_section(model_dir, args),
                f"recaption {args.arch}-{args.size} at {args.resolution} px (random weights, "
                f"fp32), batch {args.batch_size}, {args.max_new_tokens} new tokens; "
                f"{pool_label(args)}", multiples=args.multiples, repeats=args.repeats)
        print("cache, planted duplicates (a quarter of the rows repeat a photo):")
        cache_run(args.images, model_dir, args)


if __name__ == "__main__":
    main()
