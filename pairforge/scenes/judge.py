"""The automatic judge: which objects an image of the scene world shows, and where.

The background is the colour of the border; every pixel nearer an object colour than the
background colour is foreground; each connected foreground region large enough to be an
object (a small triangle covers ~3 % of the image) is one object, its colour the commonest
palette colour among its pixels, its size the box's side against the midpoint of the two
sizes. Positions follow the caption grammar: the nearest place for one object, above /
left of for two. The shape is read by a small CNN (shape_net.py) from the region's soft
foreground map, trained on renders and VQ reconstructions of the captioner split: the VQ
rounds corners, so matching the renderer's own templates (``shape="template"``, exact on
renders) reads only ~63 % of shapes in reconstructions. Tests hold the judge to >= 98 % on
renders and >= 90 % on VQ reconstructions of held-out scenes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image
from scipy import ndimage

from pairforge.scenes.world import (
    BACKGROUNDS,
    COLOURS,
    PLACES,
    SHAPES,
    SIZES,
    Scene,
    Thing,
    shape_mask,
)

MIN_AREA = 0.015  # share of the image: smaller regions are edge noise, not objects
SIZE_SPLIT = (SIZES["small"] + SIZES["large"]) / 2
_OBJECT_RGB = np.array(list(COLOURS.values()), dtype=np.float32)
_OBJECT_NAMES = list(COLOURS)
_BG_RGB = np.array(list(BACKGROUNDS.values()), dtype=np.float32)
_BG_NAMES = list(BACKGROUNDS)
ATTRIBUTES = ("count", "colour", "shape", "size", "position", "background")


def _pixels(image: Any) -> np.ndarray:
    if isinstance(image, Image.Image):
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.float32)[..., :3]


def background_of(pixels: np.ndarray) -> str:
    """The background colour nearest the median of the image's border pixels."""
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    median = np.median(border, axis=0)
    return _BG_NAMES[int(np.argmin(((_BG_RGB - median) ** 2).sum(1)))]


def _labels(pixels: np.ndarray, background: str) -> np.ndarray:
    """Per pixel: index of the nearest object colour, or -1 where the background is nearer."""
    palette = np.vstack([_OBJECT_RGB, BACKGROUNDS[background]])
    dist = ((pixels[..., None, :] - palette) ** 2).sum(-1)
    nearest = dist.argmin(-1)
    return np.where(nearest == len(_OBJECT_RGB), -1, nearest)


def template_shape(mask: np.ndarray) -> str:
    """The template with the best intersection over union inside the region's box."""
    h, w = mask.shape
    best, best_iou = SHAPES[0], -1.0
    for shape in SHAPES:
        template = np.asarray(shape_mask(shape, w, h)) > 127
        iou = (template & mask).sum() / max(1, (template | mask).sum())
        if iou > best_iou:
            best, best_iou = shape, iou
    return best


def soft_map(pixels: np.ndarray, box: tuple[slice, slice], colour: str,
             background: str) -> np.ndarray:
    """How much each pixel of the box (one pixel of margin) looks like the object colour
    rather than the background: 0..1, what the shape net reads."""
    ys, xs = box
    h, w = pixels.shape[:2]
    crop = pixels[max(0, ys.start - 1):min(h, ys.stop + 1),
                  max(0, xs.start - 1):min(w, xs.stop + 1)]
    to_bg = np.sqrt(((crop - np.asarray(BACKGROUNDS[background], np.float32)) ** 2).sum(-1))
    to_obj = np.sqrt(((crop - np.asarray(COLOURS[colour], np.float32)) ** 2).sum(-1))
    return to_bg / (to_bg + to_obj + 1e-6)


def read_objects(image: Any, shape: str = "net") -> tuple[str, list[dict[str, Any]]]:
    """(background, objects) with each object's shape, colour, size, centre (shares) and
    soft map; ``shape``: "net" (the shape CNN) or "template" (the renderer's masks)."""
    from pairforge.scenes import shape_net

    pixels = _pixels(image)
    side = max(pixels.shape[:2])
    background = background_of(pixels)
    labels = _labels(pixels, background)
    regions, _ = ndimage.label(labels >= 0, structure=np.ones((3, 3)))
    found = []
    for index, box in enumerate(ndimage.find_objects(regions), start=1):
        mask = regions[box] == index
        if mask.sum() < MIN_AREA * labels.size:
            continue
        colour = _OBJECT_NAMES[int(np.bincount(labels[box][mask]).argmax())]
        ys, xs = box
        extent = max(ys.stop - ys.start, xs.stop - xs.start) / side
        found.append({"shape": template_shape(mask), "colour": colour,
                      "size": "large" if extent > SIZE_SPLIT else "small",
                      "centre": ((xs.start + xs.stop) / 2 / pixels.shape[1],
                                 (ys.start + ys.stop) / 2 / pixels.shape[0]),
                      "area": int(mask.sum()),
                      "soft": soft_map(pixels, box, colour, background)})
    if shape == "net" and found:
        for f, name in zip(found, shape_net.classify([f["soft"] for f in found]), strict=True):
            f["shape"] = name
    return background, found


def in_caption_order(found: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(where, objects in the order a caption names them)."""
    if len(found) == 1:
        cx, cy = found[0]["centre"]
        return min(PLACES, key=lambda p: (PLACES[p][0] - cx) ** 2 + (PLACES[p][1] - cy) ** 2), \
            found
    if len(found) != 2:
        return "", found
    a, b = found
    dx, dy = b["centre"][0] - a["centre"][0], b["centre"][1] - a["centre"][1]
    if abs(dy) > abs(dx):
        where, first = "above", a if dy > 0 else b
    else:
        where, first = "left of", a if dx > 0 else b
    return where, [first, b if first is a else a]


def judge(image: Any, shape: str = "net") -> Scene:
    """The scene an image shows, in the caption grammar's terms (``where`` is '' when the
    image holds no object or more than two)."""
    background, found = read_objects(image, shape)
    where, found = in_caption_order(found)
    things = tuple(Thing(f["shape"], f["colour"], f["size"]) for f in found)
    return Scene(things, where, background)


def compare(prompt: Scene, judged: Scene) -> dict[str, bool]:
    """Which attributes of the prompt the judged scene matches; per-object attributes
    compare object by object in caption order and fail when the counts differ."""
    same_count = len(prompt.things) == len(judged.things)

    def each(field: str) -> bool:
        return same_count and all(getattr(p, field) == getattr(j, field)
                                  for p, j in zip(prompt.things, judged.things, strict=False))

    out = {"count": same_count, "colour": each("colour"), "shape": each("shape"),
           "size": each("size"), "position": same_count and prompt.where == judged.where,
           "background": prompt.background == judged.background}
    out["colour+shape"] = out["colour"] and out["shape"]
    out["all"] = all(out[a] for a in ATTRIBUTES)
    return out


def score(prompts: list[Scene], images: list[Any], shape: str = "net") -> dict[str, float]:
    """Share of images matching their prompt, per attribute and all together."""
    if not prompts:
        raise ValueError("nothing to score")
    results = [compare(p, judge(im, shape)) for p, im in zip(prompts, images, strict=True)]
    return {k: sum(r[k] for r in results) / len(results) for k in results[0]}
