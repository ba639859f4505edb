"""The captioner's quality-cost dial: its input resolution (process.recaption.input_resolution).

Image tokens dominate a VLM captioner's cost, so the side it sees is the dial between cost
per image and caption quality. This captions the bundled sample's 1,000 held-out scenes
with the demo's captioner (pairforge/sample/captioner, a BLIP trained at 32 px) through
`pairforge recaption-eval`'s own code (recaption/evaluate.caption_rows: the recaption
step's CheckedCaptioner, no cache) at each resolution, interleaved over ``--repeats``
rounds, and prints per resolution: seconds per image (median over rounds, the model load
included once per round), its ratio to the native resolution, the share of captions that
state their scene exactly (every attribute: scenes.world.parse_caption), and CIDEr-D
against the scene's exact sentence.

    python bench/recaption_resolution.py --resolutions 16,24,32 --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "pairforge" / "sample"
CONFIG = REPO / "examples" / "recaption_eval" / "config.yaml"


def heldout_table(folder: Path, n: int) -> Path:
    """The sample's held-out scenes (rows 9,000 on, exact captions) as an eval table."""
    with open(SAMPLE / "captions.csv", newline="") as f:
        rows = list(csv.DictReader(f))[9000:9000 + n]
    path = folder / "heldout.csv"
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["image", "reference", "background", "objects"])
        for row in rows:
            out.writerow([str(SAMPLE / "images" / row["filename"]), row["caption"], "all", 1])
    return path


def run(resolution: int, table: Path) -> dict[str, float]:
    from pairforge.config import load_config
    from pairforge.recaption.evaluate import caption_rows, measures, read_table
    from pairforge.scenes.world import parse_caption

    cfg = load_config(CONFIG, [f"process.recaption.input_resolution={resolution}"])
    rows = read_table(table, cfg.evaluation, [])
    started = time.perf_counter()
    caption_rows(cfg, rows)
    seconds = time.perf_counter() - started
    exact = sum(parse_caption(r.caption or "") == parse_caption(r.references[0]) for r in rows)
    return {"s_per_image": seconds / len(rows), "exact": exact / len(rows),
            "cider_d": measures(rows)["cider_d"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", default="16,24,32")
    parser.add_argument("--native", type=int, default=32, help="the model's own side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=1000)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    sides = [int(s) for s in args.resolutions.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        table = heldout_table(Path(folder), args.images)
        run(sides[-1], table)  # warm-up: imports, first model load, allocator
        results: dict[int, list[dict[str, float]]] = {s: [] for s in sides}
        for round_ in range(args.repeats):
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                results[side].append(run(side, table))
    native = statistics.median(r["s_per_image"] for r in results[args.native])
    print("| input side | ms per image (median) | vs native | captions exact | CIDEr-D |")
    print("|---:|---:|---:|---:|---:|")
    for side in sides:
        seconds = statistics.median(r["s_per_image"] for r in results[side])
        first = results[side][0]
        print(f"| {side} | {seconds * 1000:.2f} | {seconds / native:.2f}x | "
              f"{first['exact']:.3f} | {first['cider_d']:.3f} |")


if __name__ == "__main__":
    main()
