"""The budget-preserving recipe against its alternatives, on the same shards and budget.

Builds training shards from ../shared/data/coco-sample (our VQ trained here at 32 px, byte
captions, `pairforge build`), unless --shards names an existing dataset, then trains the
same tiny model with each recipe for several seeds and prints held-out L_T|I, L_I|T and
L_I|0 as mean ± std (and min..max) per recipe, plus the image tokens each run consumed.

    python bench/recipe.py                     # defaults: about 10 minutes on 2 CPU cores
    python bench/recipe.py --shards out/coco --seeds 5 --steps 300
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml
from common import COCO, arg_parser, pairforge_cli

RECIPES = [("replacement", "mixed"), ("baseline", "mixed"), ("replacement", "staged")]
METRICS = ["L_T|I", "L_I|T", "L_I|0", "L_T"]


def build_shards(work: Path, p_drop: float, shard_size: int) -> Path:
    """COCO photos + caption sidecars -> our VQ (32 px, K=64) -> training shards."""
    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    with open(COCO / "captions.csv", newline="") as f:
        for row in csv.DictReader(f):
            link = images / row["filename"]
            if not link.exists():
                link.symlink_to(COCO / "images" / row["filename"])
            link.with_suffix(".txt").write_text(row["caption"].strip())
    pairforge_cli("tokenizers", "train-vq", str(images), "--out", str(work / "vq"),
                  "--resolution", "32", "--codebook-size", "64", "--channels", "16,32",
                  "--embed-dim", "8", "--steps", "300", "--batch-size", "32")
    config = {"input": {"path": str(images), "format": "folder", "shard_size": shard_size},
              "output": {"path": str(work / "out")}, "ray": {"num_cpus": 2},
              "download": {"threads": 4, "allow_file_scheme": True,
                           "image": {"image_size": 64}},
              "dedup": {"enabled": False},
              "process": {"basic": {"min_image_side": 32},
                          "tokenize": {"enabled": True, "image": {"path_or_id": str(work / "vq")}},
                          "tasks": {"p_drop": p_drop}}}
    (work / "build.yaml").write_text(yaml.safe_dump(config))
    pairforge_cli("build", str(work / "build.yaml"), "-q")
    return work / "out"


def train_once(shards: Path, out: Path, recipe: str, schedule: str, seed: int,
               args: argparse.Namespace) -> dict:
    from pairforge.train.config import parse_train_config
    from pairforge.train.loop import train

    cfg = {"data": {"path": str(shards), "heldout_shards": args.heldout_shards,
                    "shuffle_buffer": 128, "bucket_batches": 4},
           "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
                     "max_seq_len": 320, "dropout": 0.1},
           "optim": {"lr": args.lr, "warmup_steps": 20, "weight_decay": 0.1},
           "run": {"out": str(out), "steps": args.steps, "batch_size": args.batch_size,
                   "seed": seed, "recipe": recipe, "schedule": schedule, "log_every": 50,
                   "resume": False, "threads": args.threads}}
    return train(parse_train_config(cfg), log=lambda _: None)


def _fmt(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f} ({min(values):.3f}..{max(values):.3f})"


def table(results: dict[str, list[dict]]) -> str:
    head = ("| recipe | schedule | held-out L_T\\|I | held-out L_I\\|T | held-out L_I\\|0 | "
            "held-out L_T (caption first) | image tokens after caption / none |")
    lines = [head, "|" + "---|" * 7]
    for name, reports in results.items():
        recipe, schedule = name.split("/")
        cells = [_fmt([r["final"]["heldout"][m] for r in reports]) for m in METRICS]
        b = reports[0]["budget"]
        lines.append(f"| {recipe} | {schedule} | " + " | ".join(cells) +
                     f" | {b['image_tokens_after_caption']:,} / {b['image_tokens_no_caption']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--shards", type=Path, help="an existing pairforge dataset")
    parser.add_argument("--work", type=Path, help="where to build shards and runs")
    parser.add_argument("--p-drop", type=float, default=0.3)
    parser.add_argument("--shard-size", type=int, default=50)
    parser.add_argument("--heldout-shards", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every report here")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="pairforge-recipe-"))
    started = time.perf_counter()
    shards = args.shards or build_shards(work, args.p_drop, args.shard_size)
    built = time.perf_counter() - started
    manifest = json.loads((shards / "manifest.json").read_text())
    print(f"shards: {shards} ({manifest['totals']['samples']} samples, p_drop "
          f"{manifest['budget']['p_drop']}, built in {built:.0f} s)", flush=True)
    results: dict[str, list[dict]] = {}
    for recipe, schedule in RECIPES:
        for seed in range(args.seeds):
            report = train_once(shards, work / f"{recipe}-{schedule}-{seed}", recipe, schedule,
                                seed, args)
            results.setdefault(f"{recipe}/{schedule}", []).append(report)
            h = report["final"]["heldout"]
            print(f"{recipe:11s} {schedule:6s} seed {seed}: L_T|I {h['L_T|I']:.3f} "
                  f"L_I|T {h['L_I|T']:.3f} L_I|0 {h['L_I|0']:.3f} ({report['seconds']:.0f} s)",
                  flush=True)
    print(f"\n{args.seeds} seeds, {args.steps} steps × {args.batch_size} sequences, "
          f"{results['replacement/mixed'][0]['parameters']:,} parameters, "
          f"{time.perf_counter() - started:.0f} s in all; mean ± std (min..max)\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
