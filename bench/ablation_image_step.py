"""Why bench/ablation.py has no image-based filtering arm: DataComp's image-based step,
measured in the scene world.

DataComp's best small-pool baseline keeps the rows in the top 30 % by CLIP score *and*
whose image falls in a cluster near ImageNet: the pool's CLIP image embeddings are
clustered by k-means (100,000 clusters for 12.8 M images: ~128 images a cluster), each
ImageNet training image picks its nearest cluster, and the pool's images in the picked
clusters stay. The step keeps what looks like a downstream task's pictures.

In the scene world every pool image comes from the generator the evaluation draws from,
so the step has no off-task picture to remove. This measures what it keeps with the
world CLIP's image embeddings of the ablation's training images (``--work``: an ablation
work folder, its ``site/img``), clustered at ~128 images a cluster, for three targets:

  train     training-split scenes outside the pool: the task's pictures without its test
            set, as ImageNet's training images are to DataComp
  heldout   the held-out scenes the evaluation prompts come from: the test set itself
  classes   the world's object names as text ("a red circle", 24 colours x shapes),
            the zero-shot class prompts a text target would use

and, with the ablation's ``clip-top30`` build in the folder, the rows both steps keep.

    python bench/ablation_image_step.py --work /tmp/abl-work --json /tmp/image_step.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablation import SIDE, clip_filter  # noqa: E402
from common import arg_parser  # noqa: E402

PER_CLUSTER = 128  # DataComp: 100,000 clusters for 12.8 M images


def embed(scorer: Any, pictures: list) -> np.ndarray:
    return np.concatenate([scorer.embed_images(pictures[i:i + 256])
                           for i in range(0, len(pictures), 256)])


def kept_by(pool: np.ndarray, centroids: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The pool rows whose cluster is the nearest cluster of some target row."""
    from pairforge.dedup.semantic import assign

    picked = np.unique(assign(target, centroids))
    return np.isin(assign(pool, centroids), picked)


def filtered_rows(work: Path) -> set[int] | None:
    """The training images the ablation's clip-top30 build kept, if it is there."""
    import pyarrow.parquet as pq

    shards = sorted((work / "builds" / "clip-top30" / "shards").glob("*.parquet"))
    if not shards:
        return None
    return {int(r["url"].rsplit("/t", 1)[1][:5]) for f in shards
            for r in pq.read_table(f, columns=["url", "status"]).to_pylist()
            if r["status"] == "ok" and "/img/t" in r["url"]}


def main() -> None:
    from PIL import Image

    from pairforge.config import ClipConfig
    from pairforge.dedup.semantic import kmeans
    from pairforge.filters.clip import ClipScorer
    from pairforge.scenes.world import COLOURS, SHAPES, render, scenes

    parser = arg_parser(__doc__)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--targets", type=int, default=1000, help="target images per kind")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    files = sorted((args.work / "site" / "img").glob("t*.png"))
    pool_scenes = scenes(len(files), "train")
    scorer = ClipScorer(ClipConfig(**clip_filter(0.3)))
    pool = embed(scorer, [Image.open(f).convert("RGB") for f in files])
    k = max(1, round(len(pool) / PER_CLUSTER))
    centroids = kmeans(pool, k, iterations=20, seed=0)
    targets = {
        "train": embed(scorer, [render(s, SIDE) for s in
                                scenes(args.targets, "train", start=len(files))]),
        "heldout": embed(scorer, [render(s, SIDE) for s in scenes(args.targets, "heldout")]),
        "classes": scorer.embed_texts([f"a {c} {s}" for c in COLOURS for s in SHAPES])}
    two = np.array([len(s.things) == 2 for s in pool_scenes])
    filtered = filtered_rows(args.work)
    result: dict[str, Any] = {"pool": len(pool), "clusters": k,
                              "pool_two_object_share": float(two.mean()),
                              "clip_top30_training_images": len(filtered or ())}
    for name, target in targets.items():
        kept = kept_by(pool, centroids, target)
        both = sorted(i for i in np.flatnonzero(kept) if filtered and i in filtered)
        result[name] = {"targets": len(target), "kept_share": float(kept.mean()),
                        "two_object_share_kept": float(two[kept].mean()) if kept.any() else None,
                        "kept_with_clip_top30": len(both) if filtered else None}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
