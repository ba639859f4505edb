"""Regenerate the bundled sample: drawn scenes whose captions say exactly what is drawn.

The images are made here (no third-party photos), so the project may redistribute them.
Run ``python -m pairforge.sample.generate`` to rebuild ``images/`` and ``captions.csv``.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

HERE = Path(__file__).parent
COLOURS = {"red": (206, 44, 44), "blue": (40, 90, 200), "green": (46, 150, 70),
           "yellow": (236, 200, 40), "purple": (120, 60, 160), "orange": (240, 130, 30),
           "black": (25, 25, 25), "white": (245, 245, 245)}
BACKGROUNDS = {"sky blue": (150, 200, 240), "grey": (128, 128, 128), "sand": (220, 200, 150),
               "dark green": (30, 80, 40), "pink": (240, 180, 190), "white": (250, 250, 250)}
SHAPES = ("circle", "square", "triangle", "ring")
SIZES = [(256, 256), (320, 240), (240, 320), (400, 300), (512, 512), (300, 200), (180, 180)]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int],
                colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)
    else:
        draw.ellipse(box, outline=colour, width=max(4, (x1 - x0) // 8))


def make_scene(rng: random.Random) -> tuple[Image.Image, str]:
    width, height = rng.choice(SIZES)
    bg_name, bg = rng.choice(list(BACKGROUNDS.items()))
    image = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(image)
    count = rng.choice([1, 1, 2, 3])
    shape = rng.choice(SHAPES)
    colour_name, colour = rng.choice([c for c in COLOURS.items() if c[1] != bg])
    side = min(width, height)
    for i in range(count):
        size = int(side * rng.uniform(0.25, 0.45))
        x = int((i + 0.5) * width / count - size / 2 + rng.uniform(-8, 8))
        y = int(height / 2 - size / 2 + rng.uniform(-side * 0.15, side * 0.15))
        _draw_shape(draw, shape, (x, y, x + size, y + size), colour)
    image = image.filter(ImageFilter.GaussianBlur(0.6))
    noun = shape if count == 1 else shape + "s"
    number = {1: "a", 2: "two", 3: "three"}[count]
    return image, f"{number} {colour_name} {noun} on a {bg_name} background"


def main(n: int = 48, seed: int = 7) -> None:
    rng = random.Random(seed)
    out = HERE / "images"
    out.mkdir(exist_ok=True)
    rows = []
    for i in range(n):
        image, caption = make_scene(rng)
        name = f"scene_{i:03d}.jpg"
        image.save(out / name, quality=90)
        rows.append((name, caption))
    with open(HERE / "captions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filename", "caption"])
        writer.writerows(rows)


if __name__ == "__main__":
    main()
