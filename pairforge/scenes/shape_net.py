"""The judge's shape reader: a ~47k-parameter CNN over a region's soft foreground map.

Trained (``python -m pairforge.scenes.train_shape_net``) on the objects the judge finds in renders
and in VQ reconstructions (pairforge/sample/vq32) of the captioner split, labelled with the
shapes the scenes were drawn with; never on held-out scenes. The weights ship beside this
file (shape_net.pt, ~190 kB).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pairforge.scenes.world import SHAPES

WEIGHTS = Path(__file__).with_name("shape_net.pt")
INPUT = 16  # soft maps are resized to 16 x 16


class ShapeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Linear(64, len(SHAPES)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def to_input(maps: list[np.ndarray]) -> torch.Tensor:
    """(N, 1, 16, 16) from soft maps of any size."""
    tensors = [torch.from_numpy(np.ascontiguousarray(m, np.float32))[None, None] for m in maps]
    return torch.cat([F.interpolate(t, size=(INPUT, INPUT), mode="bilinear", align_corners=False)
                      for t in tensors])


@cache
def load_model() -> ShapeNet:
    model = ShapeNet()
    model.load_state_dict(torch.load(WEIGHTS, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def classify(maps: list[np.ndarray]) -> list[str]:
    return [SHAPES[i] for i in load_model()(to_input(maps)).argmax(1).tolist()]
