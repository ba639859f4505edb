"""Regenerate the bundled sample from the scene world (pairforge/scenes): drawn scenes with
web-like alt-text, the kind of input recaptioning exists for.

The images are made here (no third-party photos), so the project may redistribute them.
``python -m pairforge.sample.generate`` rebuilds ``images/`` and ``captions.csv``: 9,000
training scenes whose alt-text is the world's corruption model at its default (half the
captions wrong: another attribute, another scene's caption, or web junk), then 1,000
held-out scenes (captions no training split holds, stated exactly) filling the last shard
of examples/demo.yaml, which examples/train_demo.yaml holds out. 9,000 scenes, not a few
hundred: on fewer the demo model memorises its pictures instead of composing prompts
(bench/RESULTS.md, the scene-world section). A seeded 5 % of the training scenes carry a
stock-photo watermark (scenes/watermark.py), which the demo's clip-head classifier finds;
their alt-text is what it would have been, as on the web.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from pairforge.scenes.corrupt import alt_texts
from pairforge.scenes.watermark import stamp
from pairforge.scenes.world import render, scenes

HERE = Path(__file__).parent
SIDE = 32  # the resolution of the bundled VQ (vq32) and captioner
WATERMARKED = 0.05  # share of training scenes stamped


def watermarked(n_train: int, share: float = WATERMARKED, seed: int = 0) -> set[int]:
    """The training scenes that carry the watermark (a seeded sample; held-out ones never)."""
    return set(random.Random(f"pairforge-sample-watermark:{seed}").sample(
        range(n_train), round(share * n_train)))


def main(n_train: int = 9000, n_heldout: int = 1000) -> None:
    out = HERE / "images"
    out.mkdir(exist_ok=True)
    for old in out.glob("scene_*"):
        old.unlink()
    train, held = scenes(n_train, "train"), scenes(n_heldout, "heldout")
    texts = alt_texts(train) + [s.sentence for s in held]
    marked = watermarked(n_train)
    rows = []
    for i, (s, text) in enumerate(zip(train + held, texts, strict=True)):
        name = f"scene_{i:05d}.png"
        picture = render(s, SIDE)
        (stamp(picture, seed=i) if i in marked else picture).save(out / name, optimize=True)
        rows.append((name, text))
    with open(HERE / "captions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filename", "caption"])
        writer.writerows(rows)


if __name__ == "__main__":
    main()
