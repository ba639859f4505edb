"""One replica's captioning: the service's cache in front of the batch step's checked captioner.

The model, backend, prompts, constrained decoding, attribute post-filter, grounding and
abstention are ``CheckedCaptioner``'s (recaption/checked.py), built from the same
``process.recaption`` section as stage 3's recaption step, so an image gets the same
caption here as in a build. What differs is only around it: the cache is
``ServeCache`` (in memory, bounded) instead of the build's parquet parts, and there is no
claim registry (a batch's duplicate uploads are captioned once here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pairforge.config import ClipConfig, RecaptionConfig, ServeCacheConfig
from pairforge.images import model_device
from pairforge.recaption.cache import CachedCaption
from pairforge.recaption.checked import FAILED, CheckedCaptioner, failed
from pairforge.serve.cache import MISS, ServeCache
from pairforge.serve.inputs import Upload


@dataclass(frozen=True)
class Answer:
    entry: CachedCaption
    cache: str  # exact | perceptual | embedding | miss

    def failure(self) -> str | None:
        """Why the captioning server gave no answer for this upload after its retries
        (the batch step's ``failed:`` flags), or None. The service answers that request
        503, caches nothing for it, and answers the batch's other uploads as usual."""
        reasons = [f for f in self.entry.flags if f.startswith(FAILED)]
        return f"the captioning server gave no answer ({', '.join(reasons)})" if reasons \
            else None


class ReplicaCaptioner:
    """Captions batches of uploads; call ``load`` once before the first batch."""

    def __init__(self, rc: RecaptionConfig, clip: ClipConfig, cache: ServeCacheConfig) -> None:
        self.checked = CheckedCaptioner(rc, clip, model_device(rc))
        self.cache = ServeCache(cache)
        self.embed_source = rc.embedding_source
        self.torch_threads = rc.torch_threads

    def load(self) -> None:
        """Load every model a request may need, so the first request does not pay for it."""
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        _ = self.checked.captioner, self.checked.grounding
        if self.cache.threshold is not None and self.embed_source == "clip":
            _ = self.checked.clip

    def caption(self, uploads: list[Upload]) -> list[Answer]:
        """The cache's answer or the model's, per upload, in order."""
        found: dict[int, Answer] = {}
        for i, upload in enumerate(uploads):
            hit = self.cache.lookup(upload.pixel_hash, upload.phash)
            if hit:
                found[i] = Answer(*hit)
        vectors = self._embed(uploads, [i for i in range(len(uploads)) if i not in found])
        for i, vector in vectors.items():
            hit = self.cache.nearest(vector)
            if hit:
                found[i] = Answer(*hit)
        first_of: dict[str, int] = {}  # a batch's duplicate uploads are captioned once
        for i, upload in enumerate(uploads):
            if i not in found:
                first_of.setdefault(upload.pixel_hash, i)
        made = self._generate(uploads, sorted(first_of.values()), vectors)
        for i, upload in enumerate(uploads):
            if i not in found:
                found[i] = Answer(made[first_of[upload.pixel_hash]], MISS)
        return [found[i] for i in range(len(uploads))]

    def _embed(self, uploads: list[Upload], indices: list[int]) -> dict[int, Any]:
        """Image vectors for the embedding tier (the batch step's sources), only when the
        tier is on and has something to compare with or to store."""
        if self.cache.threshold is None or not indices:
            return {}
        images = [uploads[i].image for i in indices]
        if self.embed_source == "captioner":
            embedded = self.checked.captioner.image_embeddings(images)
        else:
            embedded = self.checked.clip.embed_images(images)
        return dict(zip(indices, np.asarray(embedded), strict=True))

    def _generate(self, uploads: list[Upload], indices: list[int],
                  vectors: dict[int, Any]) -> dict[int, CachedCaption]:
        if not indices:
            return {}
        images = [uploads[i].image for i in indices]
        known = [vectors.get(i) for i in indices]  # CLIP's vectors serve grounding too
        given = known if self.embed_source == "clip" and all(
            v is not None for v in known) else None
        made = dict(zip(indices, self.checked.caption_images(images, given), strict=True))
        for i, entry in made.items():  # a failed one is asked again next time
            if not failed(entry):
                self.cache.add(uploads[i].pixel_hash, uploads[i].phash, entry, vectors.get(i))
        return made
