"""Regenerate the bundled sample from the scene world (pairforge/scenes): drawn scenes with
web-like alt-text, the kind of input recaptioning exists for.

The images are made here (no third-party photos), so the project may redistribute them.
``python -m pairforge.sample.generate`` rebuilds ``images/`` and ``captions.csv``: 9,000
training scenes whose alt-text is the world's corruption model at its default (half the
captions wrong: another attribute, another scene's caption, or web junk), then 1,000
held-out scenes (captions no training split holds, stated exactly) filling the last shard
of examples/demo.yaml, which examples/train_demo.yaml holds out. 9,000 scenes, not a few
hundred: on fewer the demo model memorises its pictures instead of composing prompts
(bench/RESULTS.md, the scene-world section).
"""

from __future__ import annotations

import csv
from pathlib import Path

from pairforge.scenes.corrupt import alt_texts
from pairforge.scenes.world import render, scenes

HERE = Path(__file__).parent
SIDE = 32  # the resolution of the bundled VQ (vq32) and captioner


def main(n_train: int = 9000, n_heldout: int = 1000) -> None:
    out = HERE / "images"
    out.mkdir(exist_ok=True)
    for old in out.glob("scene_*"):
        old.unlink()
    train, held = scenes(n_train, "train"), scenes(n_heldout, "heldout")
    texts = alt_texts(train) + [s.sentence for s in held]
    rows = []
    for i, (s, text) in enumerate(zip(train + held, texts, strict=True)):
        name = f"scene_{i:05d}.png"
        render(s, SIDE).save(out / name, optimize=True)
        rows.append((name, text))
    with open(HERE / "captions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filename", "caption"])
        writer.writerows(rows)


if __name__ == "__main__":
    main()
