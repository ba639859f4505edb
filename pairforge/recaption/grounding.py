"""Grounding: the object nouns of a recaption, checked against the image with CLIP.

A noun is one of the object nouns in ``data/objects.txt`` (plus user files), matched as
whole words, longest phrase first ("fire hydrant" before "fire"), plurals included. Each
noun found is scored as the cosine similarity of the image and "a photo of a NOUN" with the
stage's CLIP model; below ``min_score`` the image does not support it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import numpy as np

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


class GroundingChecker:
    """Scores nouns against images with a CLIP scorer (pairforge.filters.clip.ClipScorer)."""

    def __init__(self, scorer, lexicon: NounLexicon, min_score: float) -> None:  # noqa: ANN001
        self.scorer, self.lexicon, self.min_score = scorer, lexicon, min_score
        self._text_embeddings: dict[str, np.ndarray] = {}

    def _embed_nouns(self, nouns: list[str]) -> np.ndarray:
        new = [n for n in nouns if n not in self._text_embeddings]
        if new:
            vectors = self.scorer.embed_texts([f"a photo of a {n}" for n in new])
            self._text_embeddings.update(zip(new, vectors, strict=True))
        return np.stack([self._text_embeddings[n] for n in nouns])

    def unsupported(self, image_embeddings: np.ndarray,
                    captions: list[str | None]) -> list[list[str]]:
        """Per caption, the nouns whose score against its image is below ``min_score``."""
        result: list[list[str]] = []
        for embedding, caption in zip(image_embeddings, captions, strict=True):
            nouns = self.lexicon.nouns(caption) if caption else []
            if not nouns:
                result.append([])
                continue
            scores = self._embed_nouns(nouns) @ embedding
            result.append([n for n, s in zip(nouns, scores, strict=True)
                           if s < self.min_score])
        return result
