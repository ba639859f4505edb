"""The recaption cache: final captions keyed by image, persisted across builds.

Layout: ``CACHE/IDENTITY/BUILD-SHARD.parquet``. ``IDENTITY`` digests everything besides
the image that decides a caption (backend, model, prompt, decoding, the safety lexicons
and the grounding settings), so changing any of them starts a fresh cache instead of
reusing captions made under other rules. Each output shard's writer adds the captions the
model made for that shard before the shard's stats file, so a complete shard's captions are
always cached and a crash costs at most the captions of unfinished shards.

Lookup is by exact pixel hash; with ``phash_distance > 0`` also by perceptual hash within
that Hamming distance (pigeonhole bands), but only for captions that are not abstentions
and do not mention text: a near-identical photo of a sign may read differently. The third
tier, with ``embedding_threshold`` set, reuses the caption of the cached image whose
normalised image embedding has the highest cosine with the new image's, when it reaches
the threshold; the same exclusions apply. The vectors are the captioner's own vision
encoder's (recaption/vision.py; transformers backend) or the clip section's model's (the
vectors grounding and the clip step use; a served captioner). It saves the language
model's prefill and decode for a re-shot of the same scene that no hash catches; the
embedding is stored beside the caption.

These parts are the cache's *log*. Actors do not read it whole: stage 3 first folds it
into an index read by lookup (recaption/cache_index.py, recaption/cache_lookup.py), with
the answers :class:`CaptionCache` gives over every part (it stays as the reference, and
for callers that hold a few captions).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.recaption.prompts import DEFAULT_PROMPT
from pairforge.shards.raw import shard_name
from pairforge.shards.storage import OutputDir

if TYPE_CHECKING:  # the step's config: stage 3's section and the output section
    from pairforge.stage import StepConfig

CACHE_FOLDER = "recaption_cache"
CACHE_SCHEMA = pa.schema([("pixel_hash", pa.string()), ("phash", pa.uint64()),
                          ("recaption", pa.string()), ("flags", pa.list_(pa.string())),
                          ("embedding", pa.list_(pa.float32()))])
_TEXT_WORDS = re.compile(
    r"\b(text|texts|word|words|writing|written|letter|letters|lettering|sign|signs|signage|"
    r"label|labels|logo|logos|poster|posters|banner|banners|menu|menus|book|books|newspaper|"
    r"magazine|page|pages|screen|screens|title|caption|reads|reading|says|saying|number|"
    r"numbers|graffiti|license plate|plaque|billboard|document|handwriting|note|notes)\b",
    re.IGNORECASE)


def mentions_text(caption: str | None) -> bool:
    return bool(caption and _TEXT_WORDS.search(caption))


def _folder_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _config_digest(folder: Path) -> str | None:
    """A local model's config.json digest (None for a hub id)."""
    config_file = folder / "config.json"
    return (hashlib.sha256(config_file.read_bytes()).hexdigest()[:16]
            if config_file.is_file() else None)


def cache_identity(cfg: StepConfig) -> dict[str, Any]:
    """Everything besides the image that decides a cached caption."""
    rc = cfg.process.recaption
    data = resources.files("pairforge.recaption").joinpath("data")
    lexicons = [Path(str(p)) for p in data.iterdir() if p.name.endswith(".txt")]
    for folder in rc.attribute_lexicons:
        lexicons += sorted(Path(folder).glob("*.txt"))
    lexicons += [Path(p) for p in rc.grounding.extra_nouns]
    identity = {"backend": rc.backend, "model": rc.model, "revision": rc.revision,
                "prompt": rc.prompt or DEFAULT_PROMPT, "prompt_mode": rc.prompt_mode,
                "max_new_tokens": rc.max_new_tokens, "temperature": rc.temperature,
                "constrained": rc.constrained_decoding,
                "logit_bias": rc.openai.logit_bias_tokenizer if rc.backend == "openai" else None,
                "model_config": _config_digest(Path(rc.model)),
                "lexicons": _folder_digest(lexicons)}
    if rc.input_resolution is not None:  # (absent otherwise: earlier caches stay valid)
        identity["input_resolution"] = rc.input_resolution
    clip = cfg.process.clip
    if rc.grounding.enabled and rc.grounding.backend == "detector":
        detector = rc.grounding.detector
        identity["grounding"] = {"detector": detector.model, "revision": detector.revision,
                                 "min_score": detector.min_score, "query": detector.query,
                                 "model_config": _config_digest(Path(detector.model))}
    elif rc.grounding.enabled:
        identity["grounding"] = {"min_score": rc.grounding.min_score,
                                 "clip": f"{clip.model}/{clip.pretrained}"}
    if rc.cache.embedding_threshold is not None:  # whose vectors are stored
        identity["embedding"] = ("captioner" if rc.embedding_source == "captioner"
                                 else f"{clip.model}/{clip.pretrained}")
    return identity


def identity_digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir(cfg: StepConfig) -> OutputDir:
    """The folder of this configuration's cache entries."""
    rc = cfg.process.recaption
    root = rc.cache.path or f"{cfg.output.path.rstrip('/')}/{CACHE_FOLDER}"
    return OutputDir(f"{root.rstrip('/')}/{identity_digest(cache_identity(cfg))}",
                     cfg.output.storage_options)


def build_id(cfg: StepConfig) -> str:
    """Names this build's parts, so builds sharing a cache folder never overwrite each other."""
    return hashlib.sha256(cfg.output.path.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class CachedCaption:
    recaption: str | None  # None: the sample abstained
    flags: tuple[str, ...]

    @property
    def phash_reusable(self) -> bool:
        """Whether a near-identical image may take this caption (see the module doc)."""
        return self.recaption is not None and not mentions_text(self.recaption)


def _bands(phash: int, distance: int) -> list[tuple[int, int]]:
    """(band index, bits): ``distance + 1`` bands, so hashes within ``distance`` share one."""
    count = distance + 1
    width = 64 // count
    bands = []
    for i in range(count):
        bits = 64 - i * width if i == count - 1 else width
        bands.append((i, (phash >> (i * width)) & ((1 << bits) - 1)))
    return bands


class CaptionCache:
    """Lookups in cached captions held in dicts: ``load`` reads every part of an identity
    (the reference answers of the index, recaption/cache_lookup.py)."""

    def __init__(self, phash_distance: int = 0,
                 embedding_threshold: float | None = None) -> None:
        self.phash_distance = phash_distance
        self.embedding_threshold = embedding_threshold
        self.exact: dict[str, CachedCaption] = {}
        self.near: dict[tuple[int, int], list[tuple[int, CachedCaption]]] = {}
        self.vectors: list[np.ndarray] = []
        self.vector_entries: list[CachedCaption] = []
        self._matrix: np.ndarray | None = None  # the stacked vectors, rebuilt after an add

    @classmethod
    def load(cls, folder: OutputDir, phash_distance: int = 0,
             embedding_threshold: float | None = None) -> CaptionCache:
        cache = cls(phash_distance, embedding_threshold)
        for name in sorted(folder.glob("*.parquet")):
            with folder.fs.open(folder.path(name), "rb") as f:
                table = pq.read_table(f)
            if "embedding" not in table.column_names:  # a part written before the tier
                table = table.append_column("embedding", pa.nulls(table.num_rows))
            for row in table.to_pylist():
                cache.add(row["pixel_hash"], row["phash"],
                          CachedCaption(row["recaption"], tuple(row["flags"] or ())),
                          row["embedding"])
        return cache

    def add(self, pixel_hash: str, phash: int | None, entry: CachedCaption,
            embedding: Any = None) -> None:
        self.exact[pixel_hash] = entry
        if self.phash_distance and phash is not None and entry.phash_reusable:
            for band in _bands(phash, self.phash_distance):
                self.near.setdefault(band, []).append((phash, entry))
        if self.embedding_threshold is not None and embedding is not None \
                and entry.phash_reusable:
            self.vectors.append(np.asarray(embedding, dtype=np.float32))
            self.vector_entries.append(entry)
            self._matrix = None

    def lookup(self, pixel_hash: str, phash: int | None,
               embedding: Any = None) -> tuple[CachedCaption, str] | None:
        """(entry, tier) for the first tier that answers -- "cache" (exact pixels),
        "cache_phash", "cache_embedding" -- or None."""
        if pixel_hash in self.exact:
            return self.exact[pixel_hash], "cache"
        if self.phash_distance and phash is not None:
            for band in _bands(phash, self.phash_distance):
                for other, entry in self.near.get(band, ()):
                    if (other ^ phash).bit_count() <= self.phash_distance:
                        return entry, "cache_phash"
        return self._nearest(embedding)

    @property
    def wants_embeddings(self) -> bool:
        return self.embedding_threshold is not None and bool(self.vectors)

    def _nearest(self, embedding: Any) -> tuple[CachedCaption, str] | None:
        if embedding is None or not self.wants_embeddings:
            return None
        if self._matrix is None:
            self._matrix = np.stack(self.vectors)
        cosines = self._matrix @ np.asarray(embedding, dtype=np.float32)
        best = int(np.argmax(cosines))
        if cosines[best] >= self.embedding_threshold:
            return self.vector_entries[best], "cache_embedding"
        return None


def write_part(cfg: StepConfig, shard_id: int, rows: list[dict[str, Any]],
               column: str = "recaption") -> int:
    """Cache the captions the model made for one shard (in ``column``: a second prompt's
    are recaption_2, under the cache identity of ``cfg``'s prompt); returns how many."""
    made = [r for r in rows if r.get(f"{column}_origin") == "model"]
    if not made:
        return 0
    folder = cache_dir(cfg)
    folder.makedirs()
    table = pa.Table.from_pylist([{
        "pixel_hash": r["pixel_hash"], "phash": r["phash"], "recaption": r[column],
        "flags": r[f"{column}_flags"] or [], "embedding": r.get(f"{column}_embedding"),
    } for r in made], schema=CACHE_SCHEMA)
    with folder.open_atomic("", f"{build_id(cfg)}-{shard_name(shard_id)}.parquet") as f:
        pq.write_table(table, f)
    return len(made)
