"""A stock-photo watermark for the scene world, and a clip-head classifier that finds it.

:func:`stamp` draws the overlay web images carry: "STOCK" in half-transparent white (black
on a white background), repeated along the diagonal over the whole picture, drawn at 4x and
reduced like the scenes themselves. pairforge/sample/generate.py stamps a share of the
bundled sample with it, so the demo's watermark classifier has something to find.

``python -m pairforge.scenes.watermark`` trains the classifier: a small classifier
(an ``nn.Sequential`` of two linears with a ReLU: the clip-head backend's layout
``0.weight`` / ``2.weight`` with ``head_activation: relu``, filters/classify.py) over the
world CLIP's normalised image embeddings of captioner-split renders, half of them stamped,
and judges it on stamped and clean held-out scenes. It writes ``watermark_head.safetensors``
and ``watermark_report.json`` beside the CLIP (pairforge/sample/clip).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pairforge.scenes.clip_files import SHIPPED, SIDE, register
from pairforge.scenes.world import SUPERSAMPLE, render, scenes

HEAD = "watermark_head.safetensors"
DROP_ABOVE = 0.85  # the demo's bound: ~1 % of clean held-out scenes above it
WORD = "STOCK"
ALPHA = 120  # of 255: the scene stays visible through it


def stamp(image: Image.Image, seed: int = 0) -> Image.Image:
    """``image`` with the watermark over it; ``seed`` moves the text along the diagonal."""
    rng = random.Random(f"pairforge-watermark:{seed}")
    side = image.width * SUPERSAMPLE
    big = image.convert("RGB").resize((side, side), Image.Resampling.NEAREST).convert("RGBA")
    light = np.asarray(image.convert("L")).mean() > 200
    ink = (0, 0, 0, ALPHA) if light else (255, 255, 255, ALPHA)
    layer = Image.new("RGBA", (side * 2, side * 2), (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    font = ImageFont.load_default(size=max(8, side // 4))
    step = side // 3
    offset = rng.randrange(step)
    for row, y in enumerate(range(-step + offset, side * 2, step)):
        draw.text(((row % 2) * step, y), f"{WORD} " * 4, fill=ink, font=font)
    layer = layer.rotate(rng.choice((30, 45)), resample=Image.Resampling.BILINEAR)
    layer = layer.crop((side // 2, side // 2, side // 2 + side, side // 2 + side))
    out = Image.alpha_composite(big, layer).convert("RGB")
    return out.resize(image.size, Image.Resampling.BOX)


def _split(n: int, split: str, side: int, start: int = 0) -> tuple[list[Image.Image], list[int]]:
    """Renders of ``n`` scenes, every other one stamped, and the labels (1: stamped)."""
    images, labels = [], []
    for i, s in enumerate(scenes(n, split, start=start)):  # type: ignore[arg-type]
        picture = render(s, side)
        marked = i % 2
        images.append(stamp(picture, seed=start + i) if marked else picture)
        labels.append(marked)
    return images, labels


def fit_head(embeddings: Any, labels: Any, hidden: int = 128, steps: int = 1500,
             seed: int = 0) -> Any:
    """A one-hidden-layer ReLU MLP on the embeddings (full-batch Adam, light weight decay),
    seeded: a linear head finds the stamp at 0.86 AUC only, the MLP at ~0.99."""
    import torch

    torch.manual_seed(seed)
    x = torch.as_tensor(embeddings, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.float32)
    head = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(head(x)[:, 0], y).backward()
        optimizer.step()
    return head.eval()


def train_watermark(clip_folder: str | Path, n_train: int = 4000, n_eval: int = 1000,
                    seed: int = 0, log: Any = print) -> dict[str, Any]:
    """Teach and judge the head on the CLIP in ``clip_folder``; save both beside it."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from pairforge.config import ClipConfig
    from pairforge.filters.clip import ClipScorer
    from pairforge.scenes.clip_eval import EVAL_START, roc_auc

    started = time.perf_counter()
    scorer = ClipScorer(ClipConfig(enabled=True, batch_size=64, **register(clip_folder)))
    images, labels = _split(n_train, "captioner", SIDE)
    head = fit_head(scorer.embed_images(images), labels, seed=seed)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()},
              str(Path(clip_folder) / HEAD))
    images, truth = _split(n_eval, "heldout", SIDE, start=EVAL_START)
    with torch.no_grad():
        logits = head(torch.from_numpy(scorer.embed_images(images)))[:, 0].numpy()
    score, truth = 1 / (1 + np.exp(-logits)), np.asarray(truth, dtype=bool)
    report = {"train_scenes": n_train, "split": "captioner", "stamped_share": 0.5,
              "heldout_scenes": n_eval, "heldout_start": EVAL_START,
              "auc": roc_auc(score[truth], score[~truth]),
              "drop_above": DROP_ABOVE,
              "recall": float((score[truth] > DROP_ABOVE).mean()),
              "false_positive_rate": float((score[~truth] > DROP_ABOVE).mean()),
              "seconds": round(time.perf_counter() - started, 1)}
    (Path(clip_folder) / "watermark_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if log:
        log(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clip", type=Path, nargs="?",
                        default=SHIPPED,
                        help="the world CLIP's folder (scenes/clip.py); the head goes there")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    train_watermark(args.clip, args.train)


if __name__ == "__main__":
    main()
