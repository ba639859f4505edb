"""``pairforge serve``'s caption cache: the batch cache's three tiers, in memory, LRU-bounded.

A replica keeps up to ``max_entries`` final captions (abstentions included) keyed by the
upload's pixel hash, evicting the least recently used. The tiers answer in the batch
cache's order and with its exclusions (recaption/cache.py): exact pixels; then, when
``phash_distance > 0``, an image within that perceptual-hash distance; then, with
``embedding_threshold`` set, the cached image whose normalised embedding has the highest
cosine with the upload's, when it reaches the threshold. The near tiers never hand out an
abstention or a caption that mentions text (``CachedCaption.phash_reusable``).

The entries live in fixed slots (a uint64 array of perceptual hashes, a matrix of
embeddings) so that both near tiers are one vectorised pass over at most ``max_entries``
rows, and eviction frees a slot instead of rebuilding an index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from pairforge.config import ServeCacheConfig
from pairforge.recaption.cache import CachedCaption

# the response's ``cache`` field, per tier
EXACT, PERCEPTUAL, EMBEDDING, MISS = "exact", "perceptual", "embedding", "miss"


class ServeCache:
    """Captions by image, at most ``cfg.max_entries`` of them (not thread-safe: one
    replica's event loop owns it)."""

    def __init__(self, cfg: ServeCacheConfig) -> None:
        self.capacity = cfg.max_entries
        self.phash_distance = cfg.phash_distance
        self.threshold = cfg.embedding_threshold
        self.slots: OrderedDict[str, int] = OrderedDict()  # pixel hash -> slot, LRU first
        self.entries: list[CachedCaption | None] = [None] * self.capacity
        self.free = list(range(self.capacity - 1, -1, -1))
        self.phashes = np.zeros(self.capacity, dtype=np.uint64)
        self.near = np.zeros(self.capacity, dtype=bool)  # slots the phash tier may answer
        self.vectors: np.ndarray | None = None  # (capacity, dim), made at the first vector
        self.embedded = np.zeros(self.capacity, dtype=bool)  # slots the embedding tier may
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def wants_embeddings(self) -> bool:
        """Whether a miss of the hash tiers is worth embedding the upload for."""
        return self.threshold is not None and bool(self.embedded.any())

    def lookup(self, pixel_hash: str, phash: int | None) -> tuple[CachedCaption, str] | None:
        """The exact and perceptual tiers: (entry, tier) or None."""
        slot = self.slots.get(pixel_hash)
        if slot is not None:
            self.slots.move_to_end(pixel_hash)
            return self.entries[slot], EXACT
        if self.phash_distance and phash is not None and self.near.any():
            distances = np.bitwise_count(self.phashes ^ np.uint64(phash))
            hits = np.flatnonzero(self.near & (distances <= self.phash_distance))
            if hits.size:
                best = hits[np.argmin(distances[hits])]
                return self.entries[best], PERCEPTUAL
        return None

    def nearest(self, embedding: Any) -> tuple[CachedCaption, str] | None:
        """The embedding tier: the closest reusable entry at or over the threshold."""
        if embedding is None or not self.wants_embeddings:
            return None
        cosines = self.vectors @ np.asarray(embedding, dtype=np.float32)
        cosines[~self.embedded] = -np.inf
        best = int(np.argmax(cosines))
        if cosines[best] >= self.threshold:
            return self.entries[best], EMBEDDING
        return None

    def add(self, pixel_hash: str, phash: int | None, entry: CachedCaption,
            embedding: Any = None) -> None:
        if not self.capacity:
            return
        slot = self.slots.pop(pixel_hash, None)
        if slot is None:
            slot = self.free.pop() if self.free else self._evict()
        self.slots[pixel_hash] = slot
        self.entries[slot] = entry
        reusable = entry.phash_reusable
        self.near[slot] = bool(self.phash_distance and phash is not None and reusable)
        self.phashes[slot] = np.uint64(phash or 0)
        self.embedded[slot] = False
        if self.threshold is not None and embedding is not None and reusable:
            vector = np.asarray(embedding, dtype=np.float32)
            if self.vectors is None:
                self.vectors = np.zeros((self.capacity, vector.shape[0]), dtype=np.float32)
            self.vectors[slot] = vector
            self.embedded[slot] = True

    def _evict(self) -> int:
        _, slot = self.slots.popitem(last=False)
        self.entries[slot] = None
        self.near[slot] = self.embedded[slot] = False
        self.evictions += 1
        return slot
