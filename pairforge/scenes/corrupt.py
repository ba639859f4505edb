"""Web alt-text for the scene world: a seeded share of captions made wrong, like the web's.

Of ``n`` exact captions, exactly ``round(share * n)`` become wrong and the rest stay exact.
Of the wrong ones, exactly ``round(junk * n)`` are web junk (a file name, "image", an empty
string...); the others are split evenly between a caption with changed attributes (another
colour, shape, size, place or background: fluent, plausible and false) and another scene's
caption. A wrong caption never equals the scene's own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from pairforge.scenes.world import (
    BACKGROUNDS,
    COLOURS,
    PLACES,
    RELATIONS,
    SHAPES,
    SIZES,
    Scene,
)

KINDS = ("exact", "attribute", "other_scene", "junk")
JUNK_WORDS = ("image", "photo", "picture", "untitled", "", "thumbnail", "click here",
              "stock image", "img")


def junk_caption(rng: random.Random) -> str:
    """What alt-text often is: a camera file name, a word, or nothing."""
    kind = rng.randrange(3)
    if kind == 0:
        stem = rng.choice(("IMG_", "DSC", "image-", "upload_", "photo"))
        return f"{stem}{rng.randrange(10000):04d}.{rng.choice(('jpg', 'JPG', 'png', 'jpeg'))}"
    if kind == 1:
        return rng.choice(JUNK_WORDS)
    return ""


def change_attributes(s: Scene, rng: random.Random) -> Scene:
    """The scene with one attribute changed to another value (never the same scene)."""
    fields = ["colour", "shape", "size", "where", "background"]
    field = rng.choice(fields)
    if field == "background":
        return replace(s, background=rng.choice([b for b in BACKGROUNDS if b != s.background]))
    if field == "where":
        options = PLACES if len(s.things) == 1 else RELATIONS
        return replace(s, where=rng.choice([w for w in options if w != s.where]))
    k = rng.randrange(len(s.things))
    values = {"colour": list(COLOURS), "shape": list(SHAPES), "size": list(SIZES)}[field]
    old = getattr(s.things[k], field)
    new = replace(s.things[k], **{field: rng.choice([v for v in values if v != old])})
    return replace(s, things=s.things[:k] + (new,) + s.things[k + 1:])


def corrupt(scenes: Sequence[Scene], share: float = 0.5, junk: float = 0.02,
            seed: int = 0) -> list[tuple[str, str]]:
    """(alt-text, kind) per scene; kinds in KINDS with the exact counts described above."""
    if not 0 <= junk <= share <= 1:
        raise ValueError(f"need 0 <= junk ({junk}) <= share ({share}) <= 1")
    n = len(scenes)
    rng = random.Random(f"pairforge-alt-text:{seed}")
    wrong = rng.sample(range(n), round(share * n))
    n_junk = round(junk * n)
    n_attr = (len(wrong) - n_junk + 1) // 2
    kinds = ["exact"] * n
    for rank, i in enumerate(wrong):
        kinds[i] = "junk" if rank < n_junk else "attribute" if rank < n_junk + n_attr \
            else "other_scene"
    out = []
    for i, (s, kind) in enumerate(zip(scenes, kinds, strict=True)):
        out.append((_text(s, kind, scenes, i, rng), kind))
    return out


# The web's share of alt-text that is no description at all: empty, a file name or
# boilerplate. 20 % is the demo's default; the ablation's recorded figures used 2 %.
JUNK_SHARE = 0.2


def alt_texts(scenes: Sequence[Scene], share: float = 0.5, seed: int = 0,
              junk: float = JUNK_SHARE) -> list[str]:
    """Web alt-text as served: :func:`corrupt` at ``share``, of which ``junk`` of all
    captions (or ``share`` if less) are web junk, the rest written as sentences ("A large
    red circle ... background.") like cleaned recaptions and the evaluation prompts, so
    every caption source shares one text form; junk stays junk."""
    from pairforge.scenes.world import sentence

    noisy = corrupt(scenes, share=share, junk=min(junk, share), seed=seed)
    return [text if kind == "junk" else sentence(text) for text, kind in noisy]


def _text(s: Scene, kind: str, scenes: Sequence[Scene], i: int, rng: random.Random) -> str:
    if kind == "exact":
        return s.caption
    if kind == "junk":
        return junk_caption(rng)
    if kind == "attribute" or len(scenes) < 2:
        return change_attributes(s, rng).caption
    for _ in range(100):  # another scene's caption that is not this scene's own
        other = scenes[rng.randrange(len(scenes))].caption
        if other != s.caption:
            return other
    return change_attributes(s, rng).caption
