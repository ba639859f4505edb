"""The scene world: seeded procedural pictures whose captions say exactly what is drawn.

A scene is one or two objects (shape x colour x size) placed on a plain background. One
object sits on the left, right, top, bottom or in the middle; two objects stand one above
the other or side by side. Every scene has one exact caption in plain English, e.g.
"a large red circle above a small blue square on a white background", and
:func:`parse_caption` reads such a caption back into the scene's attributes.

Scenes are made lazily: scene ``i`` of a split is a pure function of (seed, split, i), so
any number of them (20,000 or 20 million) costs nothing until drawn. The held-out split
owns the captions whose hash falls in its share; no training split ever produces one of
those captions, so every held-out prompt is a combination the models never saw.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 225),
           "yellow": (240, 215, 40), "purple": (150, 60, 190), "orange": (245, 140, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "grey": (128, 128, 128)}
SIZES = {"small": 0.26, "large": 0.40}  # side of the object's box, as a share of the image
# where a single object stands: the centre of its box, as shares of the image side
PLACES = {"left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25),
          "bottom": (0.5, 0.75), "middle": (0.5, 0.5)}
PLACE_WORDS = {"left": "on the left", "right": "on the right", "top": "at the top",
               "bottom": "at the bottom", "middle": "in the middle"}
# two objects: the first is above / left of the second
RELATIONS = {"above": ((0.5, 0.25), (0.5, 0.75)), "left of": ((0.25, 0.5), (0.75, 0.5))}
RELATION_WORDS = {"above": "above", "left of": "to the left of"}
JITTER = 0.025  # centres move by up to this share of the side: no two renders alike
SPLITS = ("train", "captioner", "heldout")
HELDOUT_SHARE = 0.1
Split = Literal["train", "captioner", "heldout"]


@dataclass(frozen=True)
class Thing:
    """One object: what it is, regardless of where."""

    shape: str
    colour: str
    size: str

    def words(self) -> str:
        return f"{self.size} {self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """The attributes a caption states and the judge reads back.

    ``where`` is a PLACES key for one object and a RELATIONS key for two (the first object
    above / left of the second). ``centres`` (shares of the side) only place the drawing.
    """

    things: tuple[Thing, ...]
    where: str
    background: str
    centres: tuple[tuple[float, float], ...] = ()

    @property
    def caption(self) -> str:
        bg = f"on a {self.background} background"
        if len(self.things) == 1:
            return f"a {self.things[0].words()} {PLACE_WORDS[self.where]} {bg}"
        first, second = self.things
        return f"a {first.words()} {RELATION_WORDS[self.where]} a {second.words()} {bg}"

    @property
    def sentence(self) -> str:
        """The caption as a sentence ("A large red circle ... background."): the form web
        alt-text and the recaption step's cleaning (recaption/prompts.clean_caption) take,
        so the training text of every arm and the evaluation prompts share one form."""
        return sentence(self.caption)

    def attributes(self) -> Scene:
        """The scene without its drawing positions: what captions and judges compare."""
        return Scene(self.things, self.where, self.background)


def sentence(caption: str) -> str:
    """A caption of the world's grammar written as a sentence: capital first, full stop."""
    return caption[:1].upper() + caption[1:] + ("" if caption.endswith(".") else ".")


def caption_split(caption: str) -> Split:
    """heldout for a fixed ~10 % of captions (by hash), else a training caption."""
    digest = hashlib.sha256(caption.encode()).digest()
    return "heldout" if int.from_bytes(digest[:4], "big") / 2**32 < HELDOUT_SHARE else "train"


def random_scene(rng: random.Random) -> Scene:
    """Any scene of the world (attributes uniform, 1 or 2 objects with equal odds)."""
    count = rng.choice((1, 2))
    things = tuple(Thing(rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(SIZES)))
                   for _ in range(count))
    where = rng.choice(list(PLACES) if count == 1 else list(RELATIONS))
    anchors = (PLACES[where],) if count == 1 else RELATIONS[where]
    centres = tuple((x + rng.uniform(-JITTER, JITTER), y + rng.uniform(-JITTER, JITTER))
                    for x, y in anchors)
    return Scene(things, where, rng.choice(list(BACKGROUNDS)), centres)


def scene(i: int, split: Split = "train", seed: int = 0) -> Scene:
    """Scene ``i`` of ``split``: deterministic, independent of every other index.

    train and captioner draw from disjoint seed streams (no image shared) over the training
    captions; heldout draws only captions that no training split can produce.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rng = random.Random(f"pairforge-scenes:{seed}:{split}:{i}")
    want = "heldout" if split == "heldout" else "train"
    while True:  # rejection: ~1.1 draws for training splits, ~10 for heldout
        drawn = random_scene(rng)
        if caption_split(drawn.caption) == want:
            return drawn


def scenes(n: int, split: Split = "train", seed: int = 0, start: int = 0) -> list[Scene]:
    return [scene(i, split, seed) for i in range(start, start + n)]


# ---------------------------------------------------------------------------- drawing
def shape_mask(shape: str, width: int, height: int) -> Image.Image:
    """The shape filling a width x height box, as an L mask (also the judge's template)."""
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    w, h = width - 1, height - 1
    if shape == "circle":
        draw.ellipse((0, 0, w, h), fill=255)
    elif shape == "square":
        draw.rectangle((0, 0, w, h), fill=255)
    elif shape == "triangle":
        draw.polygon([(w / 2, 0), (w, h), (0, h)], fill=255)
    elif shape == "cross":
        draw.rectangle((w / 3, 0, 2 * w / 3, h), fill=255)
        draw.rectangle((0, h / 3, w, 2 * h / 3), fill=255)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return mask


SUPERSAMPLE = 4  # drawn 4x larger and reduced: smooth edges like a real picture


def render(s: Scene, side: int = 64) -> Image.Image:
    """The scene as a side x side RGB image."""
    big = side * SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUNDS[s.background])
    for thing, (cx, cy) in zip(s.things, s.centres, strict=True):
        box = max(4, round(SIZES[thing.size] * big))
        x0, y0 = round(cx * big - box / 2), round(cy * big - box / 2)
        paint = Image.new("RGB", (box, box), COLOURS[thing.colour])
        image.paste(paint, (x0, y0), shape_mask(thing.shape, box, box))
    return image.resize((side, side), Image.Resampling.BOX)


# ---------------------------------------------------------------------------- captions
_THING = (rf"(?P<{{n}}size>{'|'.join(SIZES)}) (?P<{{n}}colour>{'|'.join(COLOURS)}) "
          rf"(?P<{{n}}shape>{'|'.join(SHAPES)})")
_BG = rf" on an? (?P<bg>{'|'.join(BACKGROUNDS)}) background"
_ONE = re.compile(rf"a {_THING.format(n='a')} (?P<place>{'|'.join(PLACE_WORDS.values())})"
                  + _BG)
_TWO = re.compile(rf"a {_THING.format(n='a')} (?P<rel>{'|'.join(RELATION_WORDS.values())}) "
                  rf"a {_THING.format(n='b')}" + _BG)
_PLACE_OF = {v: k for k, v in PLACE_WORDS.items()}
_RELATION_OF = {v: k for k, v in RELATION_WORDS.items()}


def parse_caption(caption: str) -> Scene | None:
    """The scene a caption of the world's grammar states, or None for anything else."""
    text = " ".join(caption.strip().lower().rstrip(".").split())
    if m := _ONE.fullmatch(text):
        return Scene((_thing(m, "a"),), _PLACE_OF[m["place"]], m["bg"])
    if m := _TWO.fullmatch(text):
        return Scene((_thing(m, "a"), _thing(m, "b")), _RELATION_OF[m["rel"]], m["bg"])
    return None


def _thing(m: re.Match, n: str) -> Thing:
    return Thing(m[f"{n}shape"], m[f"{n}colour"], m[f"{n}size"])
