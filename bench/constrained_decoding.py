"""Constrained decoding's cost: ``generate`` with the word blocker against without it.

    python bench/constrained_decoding.py [--arch blip] [--size tiny] [--batch 32]
                                         [--tokens 24] [--repeats 5] [--threads 2]

A random-weight captioner from tests/tiny_models.py (``--size base``: the published base
architecture) with a tokenizer trained on captions that name people, so the attribute
lexicon's words (recaption/constrain.py's ``blocked_words``) are real rules: a few hundred
(prefix, token) pairs. One batch of ``--batch`` COCO photos; greedy ``generate`` with
``min_new_tokens = max_new_tokens = --tokens``, so every arm writes the same number of
tokens (random weights never end on their own). Arms, interleaved, median of
``--repeats`` calls each:

- none: no logits processor;
- host: the processor before issue 49, one ``.tolist()`` of the batch per token and a
  Python lookup per row (a device-to-host copy per token on a GPU);
- device: the processor now, the rules as tensors matched on the scores' device.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import COCO, TESTS

CAPTIONS = ["A man riding a horse.", "A woman holding her baby.", "Two boys on a road.",
            "A girl with her dog.", "A mother and her son in a park.", "A police officer.",
            "A tennis player on a court.", "A red bus on a street.", "A cat on a sofa.",
            "He is eating a pizza.", "She walks with a man and a woman.", "A bride."]


class HostProcessor:
    """The processor as it was: the generated ids read back, looked up row by row."""

    def __init__(self, blocker: Any) -> None:
        self.blocker, self.start = blocker, None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.start is None:
            self.start = input_ids.shape[1]
        for row, ids in enumerate(input_ids[:, self.start:].tolist()):
            refused = self.blocker.refused(ids)
            if refused:
                scores[row, sorted(refused)] = float("-inf")
        return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="blip", choices=["blip", "git", "idefics3"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import sys

    import torch
    from PIL import Image

    sys.path.insert(0, str(TESTS))
    from tiny_models import save_tiny_captioner

    from pairforge.config import RecaptionConfig
    from pairforge.recaption.attributes import load_lexicon
    from pairforge.recaption.backends import TransformersCaptioner
    from pairforge.recaption.constrain import blocked_words

    torch.set_num_threads(args.threads)
    folder = save_tiny_captioner(args.arch, Path(tempfile.mkdtemp()) / "captioner",
                                 CAPTIONS * 20, size=args.size)
    words = blocked_words(load_lexicon())
    captioner = TransformersCaptioner(RecaptionConfig(model=str(folder),
                                                      max_new_tokens=args.tokens),
                                      blocked=words)
    blocker = captioner.blocker
    pairs = sum(len(r[True]) + len(r[False]) for r in blocker.rules.values())
    photos = sorted((COCO / "images").glob("*.jpg"))[:args.batch]
    images = [Image.open(p).convert("RGB") for p in photos]
    inputs = captioner._inputs(images, "a photo of")

    def run(processor: Any) -> float:
        """CPU seconds of one generate (this process, every thread: steadier than wall
        time on a shared host; on CPU the two agree when the host is quiet)."""
        extra = {"logits_processor": [processor]} if processor is not None else {}
        started = time.process_time()
        with torch.inference_mode():
            out = captioner.model.generate(**inputs, max_new_tokens=args.tokens,
                                           min_new_tokens=args.tokens, do_sample=False,
                                           **extra)
        seconds = time.process_time() - started
        assert out.shape[0] == len(images)
        return seconds

    arms = {"none": lambda: None, "host": lambda: HostProcessor(blocker),
            "device": blocker.logits_processor}
    run(None)  # warm-up
    run(blocker.logits_processor())  # builds the device rules once, as a captioner does
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, make in arms.items():
            times[name].append(run(make()))
    base = statistics.median(times["none"])
    print(f"{args.arch} {args.size}, batch {len(images)}, {args.tokens} tokens, "
          f"{len(words)} blocked words -> {pairs} (prefix, token) rules, "
          f"{args.threads} threads")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:7s} median {median:.3f} CPU-s  ({median / base - 1:+.1%} over none)  "
              f"all: {' '.join(f'{v:.3f}' for v in values)}")
    print(f"  one processor call at batch {len(images)}, mid-caption: " + ", ".join(
        f"{name} {call_ms(make(), inputs, args.tokens):.3f} ms" for name, make in arms.items()
        if name != "none"))


def call_ms(processor: Any, inputs: Any, tokens: int) -> float:
    """CPU milliseconds per call of a processor on a batch that has written half its caption
    (random ids), the scores at a 30,000-token vocabulary."""
    import torch

    batch = inputs["pixel_values"].shape[0]
    ids = torch.randint(0, 500, (batch, 1 + tokens))
    scores = torch.zeros(batch, 30000)
    processor(ids[:, :1], scores)  # the caption starts after this
    started = time.process_time()
    for _ in range(50):
        processor(ids[:, :1 + tokens // 2], scores)
    return (time.process_time() - started) / 50 * 1000


if __name__ == "__main__":
    main()
