"""Train the judge's shape reader (scenes/shape_net.py): ``python -m
pairforge.scenes.train_shape_net`` fits it on the objects the judge finds in renders and in
VQ reconstructions of the captioner split, and saves the weights beside shape_net.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pairforge.scenes import shape_net
from pairforge.scenes.judge import in_caption_order, read_objects
from pairforge.scenes.world import SHAPES, render, scenes
from pairforge.tokenizers.vq_tokenizer import PairforgeVQTokenizer


def examples(images: list[Any], truth: list[Any]) -> tuple[list[np.ndarray], list[int]]:
    """Soft maps of the objects the judge finds, labelled by the drawn shape, from images
    where it finds the drawn number of objects in the drawn colours."""
    maps, labels = [], []
    for image, scene in zip(images, truth, strict=True):
        _, found = read_objects(image, shape="template")
        _, found = in_caption_order(found)
        if [f["colour"] for f in found] != [t.colour for t in scene.things]:
            continue
        for f, thing in zip(found, scene.things, strict=True):
            maps.append(f["soft"])
            labels.append(SHAPES.index(thing.shape))
    return maps, labels


def train(n_scenes: int = 3000, steps: int = 1500, vq: str | Path | None = None,
          seed: int = 0, log: Any = print) -> dict[str, Any]:
    """Fit on renders and VQ reconstructions of the captioner split; save WEIGHTS."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    drawn = scenes(n_scenes, "captioner", seed=7)
    renders = [render(s, 32) for s in drawn]
    tokenizer = PairforgeVQTokenizer(vq or Path(__file__).parents[1] / "sample" / "vq32")
    recons = tokenizer.decode(tokenizer.encode(renders))
    maps, labels = examples(renders + recons, drawn + drawn)
    x, y = shape_net.to_input(maps), torch.tensor(labels)
    model = shape_net.ShapeNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 3e-3, total_steps=steps)
    for step in range(steps):
        pick = torch.randint(0, len(y), (128,))
        batch = x[pick]
        flip = torch.rand(len(pick)) < 0.5  # every shape is left-right symmetric
        batch = torch.where(flip[:, None, None, None], batch.flip(-1), batch)
        loss = F.cross_entropy(model(batch), y[pick])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if log and step % 500 == 0:
            log(f"step {step}/{steps} loss {loss.item():.4f}")
    torch.save(model.state_dict(), shape_net.WEIGHTS)
    shape_net.load_model.cache_clear()
    report = {"objects": len(y), "scenes": n_scenes, "steps": steps,
              "train_accuracy": float((model.eval()(x).argmax(1) == y).float().mean()),
              "seconds": round(time.perf_counter() - started, 1)}
    if log:
        log(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--vq", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train(args.scenes, args.steps, args.vq)


if __name__ == "__main__":
    main()
