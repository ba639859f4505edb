"""Grounding: the object nouns of a recaption, checked against the image.

A noun is one of the object nouns in ``data/objects.txt`` (plus user files), matched as
whole words, longest phrase first ("fire hydrant" before "fire"), plurals included. Two
backends score each noun found, with the same answer (the nouns below the threshold), so
the recaption step does not care which ran:

* ``clip``: the cosine similarity of the image and "a photo of a NOUN" with the stage's
  CLIP model (:class:`ClipGrounding`);
* ``detector``: the best box score of an open-vocabulary detector (OWL-ViT, OWLv2) queried
  with the caption's nouns (recaption/detector.py).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pairforge.recaption.words import plural

NOUN_FILE = "objects.txt"
# people are the attribute filter's business; these words are never grounding nouns
_PEOPLE = {"person", "people", "persons", "human", "humans"}


def _parse(lines: Iterable[str]) -> dict[str, str]:
    """surface form -> singular noun"""
    forms: dict[str, str] = {}
    for line in lines:
        line = line.split("#", 1)[0].strip().lower()
        if not line:
            continue
        noun, _, irregular = (part.strip() for part in line.partition(","))
        forms[noun] = noun
        forms[irregular or plural(noun)] = noun
    return forms


class NounLexicon:
    def __init__(self, extra_files: Iterable[str] = ()) -> None:
        text = resources.files("pairforge.recaption").joinpath("data", NOUN_FILE).read_text()
        lines = text.splitlines()
        for path in extra_files:
            lines += Path(path).read_text().splitlines()
        self.forms = {k: v for k, v in _parse(lines).items() if k not in _PEOPLE}
        alternatives = sorted(self.forms, key=lambda f: (-len(f), f))
        self._pattern = re.compile(
            r"\b(" + "|".join(re.escape(f) for f in alternatives) + r")\b", re.IGNORECASE)

    def nouns(self, caption: str) -> list[str]:
        """Singular object nouns named in ``caption``, in order, each once."""
        found = [self.forms[m.group(1).lower()] for m in self._pattern.finditer(caption)]
        return list(dict.fromkeys(found))


class Grounding(ABC):
    """Which nouns of each caption its image does not support."""

    #: the step hands over the clip model's image embeddings (computed once per batch)
    uses_clip_embeddings = False

    def __init__(self, lexicon: NounLexicon, min_score: float) -> None:
        self.lexicon, self.min_score = lexicon, min_score

    @abstractmethod
    def scores(self, images: list[Image.Image], nouns: list[list[str]],
               embeddings: list[Any]) -> list[list[float]]:
        """Per image, a score for each of its nouns (higher: better supported)."""

    def unsupported(self, images: list[Image.Image], captions: list[str | None],
                    embeddings: list[Any] | None = None) -> list[list[str]]:
        """Per caption, the nouns whose score against its image is below ``min_score``;
        ``embeddings``: the images' clip embeddings when the backend uses them."""
        nouns = [self.lexicon.nouns(caption) if caption else [] for caption in captions]
        embeddings = embeddings if embeddings is not None else [None] * len(images)
        scored = self.scores(images, nouns, embeddings)
        return [[n for n, s in zip(names, values, strict=True) if s < self.min_score]
                for names, values in zip(nouns, scored, strict=True)]


class ClipGrounding(Grounding):
    """Scores nouns against images with a CLIP scorer (pairforge.filters.clip.ClipScorer)."""

    uses_clip_embeddings = True

    def __init__(self, scorer, lexicon: NounLexicon, min_score: float) -> None:  # noqa: ANN001
        super().__init__(lexicon, min_score)
        self.scorer = scorer
        self._text_embeddings: dict[str, np.ndarray] = {}

    def _embed_nouns(self, nouns: list[str]) -> np.ndarray:
        new = [n for n in nouns if n not in self._text_embeddings]
        if new:
            vectors = self.scorer.embed_texts([f"a photo of a {n}" for n in new])
            self._text_embeddings.update(zip(new, vectors, strict=True))
        return np.stack([self._text_embeddings[n] for n in nouns])

    def scores(self, images: list[Image.Image], nouns: list[list[str]],
               embeddings: list[Any]) -> list[list[float]]:
        missing = [i for i, (names, e) in enumerate(zip(nouns, embeddings, strict=True))
                   if names and e is None]
        if missing:  # a caller without the clip step's vectors
            computed = self.scorer.embed_images([images[i] for i in missing])
            embeddings = list(embeddings)
            for i, vector in zip(missing, computed, strict=True):
                embeddings[i] = vector
        return [(self._embed_nouns(names) @ np.asarray(e)).tolist() if names else []
                for names, e in zip(nouns, embeddings, strict=True)]
