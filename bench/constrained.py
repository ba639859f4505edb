"""Constrained decoding: how many strict regenerations it saves (issue 20).

    python bench/constrained.py [--steps 80] [--photos 12]

A tiny BLIP (pairforge.recaption.tiny) is taught hand-written captions full of people for
COCO photos from ../shared/data: some rewrite fluently ("A man riding a horse." -> "A
person riding a horse."), some cannot ("The woman's son ..." -> "The person's person ...",
which the step sends back for a strict regeneration). The same model then captions the
same photos twice, free and with constrained decoding, and each caption goes through the
step's own first-attempt checks (clean_caption, the attribute filter; grounding off, as
it needs a CLIP model): a caption with a problem costs one regeneration. Prints both
counts and the attribute removals.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

from PIL import Image

from pairforge.config import RecaptionConfig
from pairforge.recaption.attributes import load_lexicon, neutralize
from pairforge.recaption.backends import load_captioner
from pairforge.recaption.constrain import blocked_words
from pairforge.recaption.prompts import clean_caption
from pairforge.recaption.tiny import fit_captioner, save_tiny_captioner

COCO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "coco-sample"
TAUGHT = ["A man riding a horse on a beach.", "The woman's son holding a kite.",
          "A young girl eating a sandwich.", "The man's wife sitting on a bench.",
          "Two boys playing soccer in a field.", "A woman and her husband's dog.",
          "An old man reading a newspaper.", "The girl's brother on a skateboard.",
          "A mother holding an umbrella.", "The boy's father flying a kite.",
          "A lady with a red bag.", "The woman's daughter riding a bicycle."]


def first_attempt(captions: list[str]) -> dict[str, int]:
    """What the step's checks do with first tries: regenerations and removals."""
    regenerate = removed = 0
    for raw in captions:
        text = clean_caption(raw)
        result = neutralize(text) if text else None
        regenerate += result is None or not result.fluent
        removed += bool(result and result.removed)
    return {"regenerations": regenerate, "with_attributes_removed": removed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--photos", type=int, default=len(TAUGHT))
    args = parser.parse_args()
    with open(COCO / "captions.csv", newline="") as f:
        names = [r["filename"] for r in csv.DictReader(f)][:args.photos]
    # the model sees 32 px: resizing once here keeps the teaching steps cheap
    photos = [Image.open(COCO / "images" / n).convert("RGB").resize((32, 32)) for n in names]
    taught = [TAUGHT[i % len(TAUGHT)] for i in range(len(photos))]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_captioner("blip", Path(tmp) / "blip", taught * 4, resolution=32)
        start = time.perf_counter()
        fit_captioner(folder, photos, taught, steps=args.steps)
        print(f"taught {len(photos)} captions in {time.perf_counter() - start:.0f} s")
        cfg = RecaptionConfig(model=str(folder), max_new_tokens=20)
        runs = {"free": None, "constrained": blocked_words(load_lexicon())}
        for name, blocked in runs.items():
            captioner = load_captioner(cfg, "cpu", blocked)
            start = time.perf_counter()
            captions = captioner.generate(photos, "x")
            seconds = time.perf_counter() - start
            counts = first_attempt(captions)
            print(f"{name}: {counts['regenerations']}/{len(photos)} regenerations, "
                  f"{counts['with_attributes_removed']} with attributes removed, "
                  f"generate {seconds:.2f} s; e.g. {captions[:3]}")


if __name__ == "__main__":
    main()
