"""Regenerate the bundled sample from the scene world (pairforge/scenes): drawn scenes whose
captions say exactly what is drawn.

The images are made here (no third-party photos), so the project may redistribute them.
``python -m pairforge.sample.generate`` rebuilds ``images/`` and ``captions.csv``: training
scenes first, then held-out scenes (captions no training split holds) filling the last
shard of examples/demo.yaml, which examples/train_demo.yaml holds out.
"""

from __future__ import annotations

import csv
from pathlib import Path

from pairforge.scenes.world import render, scenes

HERE = Path(__file__).parent
SIDE = 32  # the resolution of the bundled VQ (vq32) and captioner


def main(n_train: int = 960, n_heldout: int = 64) -> None:
    out = HERE / "images"
    out.mkdir(exist_ok=True)
    for old in out.glob("scene_*"):
        old.unlink()
    rows = []
    drawn = scenes(n_train, "train") + scenes(n_heldout, "heldout")
    for i, s in enumerate(drawn):
        name = f"scene_{i:04d}.png"
        render(s, SIDE).save(out / name, optimize=True)
        rows.append((name, s.sentence))  # the form cleaned recaptions take
    with open(HERE / "captions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filename", "caption"])
        writer.writerows(rows)


if __name__ == "__main__":
    main()
