"""Rebuild examples/recaption_eval/scenes.csv from the bundled sample (pairforge/sample).

The rows are the first 60 of the sample's 1,000 held-out scenes (scene_09000.png on),
whose captions in pairforge/sample/captions.csv are the scene world's exact captions
(pairforge/sample/generate.py), so they are true references; the strata are read back from
each caption by the world's own parser: the background colour and the number of objects.
The images stay in the package; the table names them relative to its own folder.

    python examples/recaption_eval/make_table.py
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from pairforge.scenes.world import parse_caption

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parents[1] / "pairforge" / "sample"
FIRST_HELDOUT, ROWS = 9000, 60


def main() -> None:
    with open(SAMPLE / "captions.csv", newline="") as f:
        sample = list(csv.DictReader(f))[FIRST_HELDOUT:FIRST_HELDOUT + ROWS]
    with open(HERE / "scenes.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "reference", "background", "objects"])
        for row in sample:
            scene = parse_caption(row["caption"])
            assert scene is not None, row  # held-out captions are exact
            image = os.path.relpath(SAMPLE / "images" / row["filename"], HERE)
            writer.writerow([image, row["caption"], scene.background, len(scene.things)])


if __name__ == "__main__":
    main()
