"""The recaption step of stage 3: a VLM caption per image, made safe, cached by image.

For each ok row: the cache (pixel hash, optionally perceptual hash and image embedding:
the captioner's own or CLIP's) answers first; else the row's image is claimed in the
build's claim registry, and only the claimant runs the model, so duplicates within a build
are captioned once.
Captioning itself is recaption/checked.py's (shared with ``pairforge recaption-eval``): a
generated caption is cleaned (one sentence, no boilerplate), passed through the
people-attribute filter and the grounding check (CLIP or an open-vocabulary detector,
recaption/grounding.py); if the filter could not rewrite it fluently or grounding does
not support one of its object nouns, the model tries once more with a stricter prompt,
and if that fails too the sample abstains (no recaption). The training caption is chosen
after this step, in recaption/choice.py.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
from PIL import Image

from pairforge.config import ModelPoolConfig
from pairforge.filters.clip import ClipScorer, clip_source
from pairforge.filters.clip_view import clip_view
from pairforge.images import RGB, ImageView, model_device, view_images
from pairforge.recaption.cache import CachedCaption, build_id, cache_dir, write_part
from pairforge.recaption.cache_lookup import IndexedCaptionCache
from pairforge.recaption.checked import CheckedCaptioner, failed
from pairforge.recaption.claims import (
    REGISTRY_PREFIX,
    find_registry,
    registry_parts,
    start_registry,
    stop_registry,
)
from pairforge.recaption.detector import OWL_TYPES
from pairforge.recaption.openai_client import batches_in_flight
from pairforge.records import process_columns
from pairforge.sources import (
    TOKENIZER_FILES,
    TRANSFORMERS_FILES,
    ModelFile,
    ModelFolder,
    ModelSource,
    ServedModel,
)
from pairforge.stage import ModelStep, Requirements, StepConfig, StepResult, setting_values

WAIT_FOR_CLAIMANT_S = 600.0
# what changes how fast a server answers, not what it writes
SERVER_SPEED_KEYS = ("openai.concurrency", "openai.timeout_s", "openai.retries")
DETECTOR_KEYS = ("grounding.backend", "grounding.detector")
# a transformers captioner's actor: one batch generating, one checking or being read
MODEL_BATCHES_IN_FLIGHT = 2


def registry_name(cfg: StepConfig, column: str = "recaption") -> str:
    """The build's claim registry of one recaption column (each prompt claims its own)."""
    return REGISTRY_PREFIX + build_id(cfg) + ("" if column == "recaption" else f"-{column}")


def recaption_sources(cfg: StepConfig) -> tuple[ModelSource, ...]:
    """The captioner (a model folder or hub id, or a served model), the served model's
    tokenizer for logit_bias, the grounding model (the clip section's, which the CLIP
    embedding tier of the cache also loads, or a detector) and the word lists."""
    rc = cfg.process.recaption
    key = "process.recaption"
    sources: list[ModelSource] = []
    if rc.backend == "transformers":
        sources.append(ModelFolder(f"{key}.model", rc.model, TRANSFORMERS_FILES, rc.revision))
    else:
        sources.append(ServedModel(f"{key}.model", rc.model, rc.openai.base_url,
                                   f"{key}.openai.base_url", rc.openai.api_key_env,
                                   rc.openai.timeout_s))
        if rc.openai.logit_bias_tokenizer:
            # not fingerprinted: shards record it by name, as they always did
            sources.append(ModelFolder(f"{key}.openai.logit_bias_tokenizer",
                                       rc.openai.logit_bias_tokenizer, (TOKENIZER_FILES,),
                                       fingerprint=False))
    grounding = rc.grounding
    clip_tier = rc.cache.embedding_threshold is not None and rc.embedding_source == "clip"
    if (grounding.enabled and grounding.backend == "clip") or clip_tier:
        sources.append(clip_source(cfg))
    if grounding.enabled and grounding.backend == "detector":
        detector = grounding.detector
        sources.append(ModelFolder(f"{key}.grounding.detector.model", detector.model,
                                   TRANSFORMERS_FILES, detector.revision,
                                   check=_owl_check(detector.model)))
    # word lists are recorded by their config value (as they always were), not their bytes
    sources += [ModelFolder(f"{key}.attribute_lexicons", folder, hub=False, fingerprint=False)
                for folder in rc.attribute_lexicons]
    if grounding.enabled:
        sources += [ModelFile(f"{key}.grounding.extra_nouns", path, fingerprint=False)
                    for path in grounding.extra_nouns]
    return tuple(sources)


def _owl_check(model: str):  # noqa: ANN202 - a SourceCheck
    """The detector's config.json names a model type the detector backend reads."""
    def check(config_json: str) -> list[str]:
        model_type = json.loads(Path(config_json).read_text()).get("model_type")
        if model_type in OWL_TYPES:
            return []
        return [f"process.recaption.grounding.detector.model: {model} is a {model_type} "
                f"model, not an open-vocabulary detector this backend reads "
                f"({' or '.join(OWL_TYPES)}: e.g. google/owlv2-base-patch16-ensemble)"]

    return check


def recaption_stats(rows: list[dict[str, Any]], column: str = "recaption") -> dict[str, Any]:
    """Where each recaption (of ``column``) came from and what the safety checks did, for
    a shard's stats."""
    done = [r for r in rows if r.get(f"{column}_origin")]
    # "attribute:gender:woman" counts as attribute:gender, "abstained:ungrounded:dog" as
    # abstained:ungrounded: the kind of check, not the word
    flags = Counter(":".join(f.split(":")[:2]) for r in done
                    for f in r[f"{column}_flags"] or [])

    def rows_flagged(prefix: str) -> int:
        return sum(any(f.startswith(prefix) for f in r[f"{column}_flags"] or []) for r in done)

    return {"rows": len(done),
            "origin": dict(sorted(Counter(r[f"{column}_origin"] for r in done).items())),
            # no caption trusted (the checks), apart from no answer at all (the backend)
            "abstained": sum(r[column] is None and r[f"{column}_origin"] != "failed"
                             for r in done),
            "failed": sum(r[f"{column}_origin"] == "failed" for r in done),
            "rows_with_attributes_removed": rows_flagged("attribute:"),
            "regenerated": rows_flagged("regenerated:"),
            "flags": dict(sorted(flags.items())),
            "caption_source": dict(sorted(Counter(
                r.get("caption_source") or "none" for r in done).items())),
            # kept rows whose alt-text could not train (caption_issue): recaptioning's rescue
            "rescued": sum(r.get("status") == "ok" and r.get("caption_issue") is not None
                           and r.get("caption_source") == column for r in done)}


class RecaptionStep(ModelStep):
    name = "recaption"
    column: ClassVar[str] = "recaption"  # and COLUMN_flags, COLUMN_origin, COLUMN_embedding
    requires = ("image", "caption", "pixel_hash", "phash")
    provides = process_columns("recaption", "recaption_flags", "recaption_origin",
                               "recaption_embedding")

    @classmethod
    def step_config(cls, cfg: StepConfig) -> StepConfig:
        """The config this step captions under (its prompt)."""
        return cfg

    @classmethod
    def pool_config(cls, cfg: StepConfig) -> ModelPoolConfig:
        return cfg.process.recaption

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        return cfg.process.recaption.enabled

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        rc = cfg.process.recaption
        # a detector's keys are recorded only when it grounds: with CLIP grounding, shards
        # have the settings they had before the detector existed
        skip = SERVER_SPEED_KEYS + (DETECTOR_KEYS if rc.grounding.backend == "clip" else ())
        if rc.cache.embedding_threshold is None:  # the probes matter only with the tier on
            skip += ("cache.embedding_probes",)
        return Requirements(display=rc.model, sources=recaption_sources(cfg),
                            settings=setting_values(rc, "process.recaption.", skip))

    @classmethod
    def manifest_entries(cls, cfg: StepConfig, first: dict[str, Any],
                         totals: dict[str, Any]) -> dict[str, Any]:
        rc = cfg.process.recaption
        return {"models": {"recaption": rc.model if rc.enabled else None}}

    @classmethod
    def image_views(cls, cfg: StepConfig) -> tuple[ImageView, ...]:
        """The decoded image for the captioner (its processor resizes), and CLIP's picture
        where CLIP encodes images here: the embedding tier's or clip grounding's vectors
        (the clip step's column when it runs: the same view)."""
        rc = cfg.process.recaption
        clip_here = (rc.cache.enabled and rc.cache.embedding_threshold is not None
                     and rc.embedding_source == "clip") or (
            rc.grounding.enabled and rc.grounding.backend == "clip")
        return (RGB, *(clip_view(cfg.process.clip) if clip_here else ()))

    @classmethod
    def concurrent_batches(cls, cfg: StepConfig) -> int:
        """A server's actor works on several batches at once, so that its
        ``openai.concurrency`` requests stay in flight while a batch waits for its slowest
        answer; a model's actor on two, so that one batch's strict retries ride in the
        same generate calls as the next batch's rows (recaption/rounds.py) instead of a
        short call of their own, and the next batch's decoding and cache lookups overlap
        a generation. Model calls still take one lock: one batch of activations at a time."""
        rc = cfg.process.recaption
        if rc.backend != "openai":
            return MODEL_BATCHES_IN_FLIGHT
        return batches_in_flight(rc.openai.concurrency, rc.batch_size)

    def __init__(self, cfg: StepConfig) -> None:
        super().__init__(cfg)
        cfg = self.step_config(cfg)
        rc = cfg.process.recaption
        self.device = model_device(rc)
        self.checked = CheckedCaptioner(rc, cfg.process.clip, self.device)
        # read by lookup, a bounded number of partitions held (recaption/cache_lookup.py)
        self.cache = IndexedCaptionCache(cache_dir(cfg) if rc.cache.enabled else None,
                                         rc.cache.phash_distance, rc.cache.embedding_threshold,
                                         probes=rc.cache.embedding_probes)
        self.embed_tier = rc.cache.enabled and rc.cache.embedding_threshold is not None
        self.embed_source = rc.embedding_source
        # with dedup on, build_scope starts no registry: nothing to look for (nor a Ray to ask)
        self.registry = (None if cfg.exact_dedup
                         else find_registry(registry_name(cfg, self.column)))
        # concurrent batches (concurrent_batches): the cache's partition LRU is not
        # thread-safe; model calls take self.checked.lock; registry calls are Ray's
        self.cache_lock = threading.Lock()

    def teardown(self) -> None:
        self.checked.close()

    @classmethod
    @contextlib.contextmanager
    def build_scope(cls, cfg: StepConfig, rows: int) -> Iterator[None]:
        """The build's claim registry lives as long as the stage-3 run, one actor per
        ``claims.ROWS_PER_PART`` of its rows. With dedup on, stage 2 has dropped every
        pixel-identical copy, so no two rows can claim one image: no registry is started,
        and the actors find none and caption their own rows."""
        if cfg.exact_dedup:
            yield
            return
        registry = start_registry(registry_name(cfg, cls.column), registry_parts(rows))
        try:
            yield
        finally:
            stop_registry(registry)

    @classmethod
    def finish_shard(cls, cfg: StepConfig, shard_id: int,
                     rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Cache the shard's captions (before its stats file: a complete shard's captions
        are always in the cache) and count what the checks did."""
        if cfg.process.recaption.cache.enabled:
            write_part(cls.step_config(cfg), shard_id, rows, cls.column)
        for row in rows:  # the embedding is the cache's, not the dataset's
            row.pop(f"{cls.column}_embedding", None)
        return recaption_stats(rows, cls.column)

    @property
    def clip(self) -> ClipScorer:
        """The clip section's model, shared by clip grounding and the embedding tier."""
        return self.checked.clip

    def caption_images(self, images: list[Image.Image],
                       embeddings: list[Any] | None = None) -> list[CachedCaption]:
        """Captions with the safety checks (recaption/checked.py)."""
        return self.checked.caption_images(images, embeddings)

    # -- the batch: cache, claims, generation -----------------------------------------------

    def _claims(self, items: list[tuple[str, str]]) -> list[str]:
        if self.registry is None:
            return [k for _, k in items]
        return self._call(self.registry.claim, items) or [k for _, k in items]

    def _call(self, method: Any, *args: Any) -> Any:
        """A registry call; a lost registry only costs the within-build sharing."""
        result = method(*args)
        if self.registry is not None and self.registry.lost:
            self.registry = None
        return result

    def _generate_for(self, rows: pa.Table, indices: list[int],
                      vectors: dict[int, Any]) -> dict[int, CachedCaption]:
        if not indices:
            return {}
        images = view_images(rows.take(indices), RGB)
        given = self._clip_vectors(rows, indices, vectors)
        return dict(zip(indices, self.caption_images(images, given), strict=True))

    def _clip_vectors(self, rows: pa.Table, indices: list[int],
                      vectors: dict[int, Any]) -> list[Any] | None:
        """The CLIP image vectors of ``indices`` that clip grounding can read instead of
        encoding the images again: the embedding tier's, when CLIP made them, else the clip
        step's (None where neither has one; None for all: no vector known)."""
        kept = (rows["clip_embedding"].to_pylist() if "clip_embedding" in rows.column_names
                else [None] * rows.num_rows)
        given = []
        for i in indices:
            vector = vectors.get(i) if self.embed_source == "clip" else None
            if vector is None and kept[i] is not None:
                vector = np.asarray(kept[i], dtype=np.float32)
            given.append(vector)
        return None if all(v is None for v in given) else given

    def _embed(self, rows: pa.Table, indices: list[int]) -> dict[int, Any]:
        """Image vectors for the embedding tier: the captioner's own, or CLIP's (the clip
        step's where it kept them, else encoded here with the same model)."""
        if not self.embed_tier or not indices:
            return {}
        if self.embed_source == "captioner":
            images = view_images(rows.take(indices), RGB)
            return dict(zip(indices, self.checked.captioner.image_embeddings(images),
                            strict=True))
        kept = (rows["clip_embedding"].to_pylist() if "clip_embedding" in rows.column_names
                else [None] * rows.num_rows)
        vectors = {i: np.asarray(kept[i], dtype=np.float32) for i in indices
                   if kept[i] is not None}
        missing = [i for i in indices if i not in vectors]
        if missing:
            pictures = view_images(rows.take(missing), self.clip.view)
            vectors.update(zip(missing, self.clip.embed_view(pictures), strict=True))
        return vectors

    def process(self, rows: pa.Table) -> StepResult:
        keys = rows["key"].to_pylist()
        hashes = rows["pixel_hash"].to_pylist()
        phashes = rows["phash"].to_pylist()
        # the batch's hashes by partition, each partition read once
        with self.cache_lock:
            found = self.cache.lookup_batch(hashes, phashes)
        with self.checked.lock:
            vectors = self._embed(rows, [i for i in range(rows.num_rows) if i not in found])
        with self.cache_lock:
            found.update(self.cache.lookup_embeddings(vectors))
        todo = [i for i in range(rows.num_rows) if i not in found]
        leaders = dict(zip(todo, self._claims([(hashes[i], keys[i]) for i in todo]),
                           strict=True))
        first_of: dict[str, int] = {}  # pixel hash -> the row of this batch that captions it
        mine = []
        for i in todo:
            if leaders[i] == keys[i] and hashes[i] not in first_of:
                first_of[hashes[i]] = i
                mine.append(i)
        made = self._generate_for(rows, mine, vectors)
        found.update((i, (entry, _origin(entry, "model"))) for i, entry in made.items())
        # failures are published too: other actors' rows of the image end at once as
        # failed instead of waiting WAIT_FOR_CLAIMANT_S for a caption that never comes
        if made and self.registry is not None:
            self._call(self.registry.publish, {hashes[i]: e for i, e in made.items()})
        self._resolve_followers(rows, [i for i in todo if i not in made], found, first_of,
                                vectors)
        made_vectors = [vectors.get(i) if found[i][1] == "model" else None
                        for i in range(rows.num_rows)]
        return self._columns([found[i] for i in range(rows.num_rows)], made_vectors)

    def _resolve_followers(self, rows: pa.Table, followers: list[int],
                           found: dict[int, tuple[CachedCaption, str]],
                           first_of: dict[str, int], vectors: dict[int, Any]) -> None:
        """Rows whose image another row captions: copy, or wait for the other actor."""
        hashes = rows["pixel_hash"].to_pylist()
        remote = sorted({hashes[i] for i in followers if hashes[i] not in first_of})
        published = (self._call(self.registry.wait, remote, WAIT_FOR_CLAIMANT_S) or {}
                     if remote and self.registry is not None else {})
        orphans = []
        for i in followers:
            h = hashes[i]
            if h in first_of and first_of[h] in found:
                found[i] = (found[first_of[h]][0], _origin(found[first_of[h]][0], "build"))
            elif h in published:
                found[i] = (published[h], _origin(published[h], "build"))
            else:
                orphans.append(i)
        found.update((i, (e, _origin(e, "model")))
                     for i, e in self._generate_for(rows, orphans, vectors).items())

    def _columns(self, results: list[tuple[CachedCaption, str]],
                 vectors: list[Any]) -> StepResult:
        column = self.column
        return StepResult(columns={
            column: [e.recaption for e, _ in results],
            f"{column}_flags": [list(e.flags) for e, _ in results],
            f"{column}_origin": [origin for _, origin in results],
            f"{column}_embedding": [None if v is None else np.asarray(v).tolist()
                                    for v in vectors],
        })


def _origin(entry: CachedCaption, origin: str) -> str:
    """``failed`` for a row the backend could not answer (never cached: a rerun asks
    again), else where its caption came from."""
    return "failed" if failed(entry) else origin


class SecondRecaptionStep(RecaptionStep):
    """The same captioner and checks under ``recaption.second_prompt`` (the design's
    instruction control: a short caption and a detailed one), as column ``recaption_2``:
    its own cache identity (the prompt is part of it) and its own claim registry."""

    name = "recaption_2"
    column = "recaption_2"
    provides = process_columns("recaption_2", "recaption_2_flags", "recaption_2_origin",
                               "recaption_2_embedding")

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        rc = cfg.process.recaption
        return rc.enabled and rc.second_prompt is not None

    @classmethod
    def step_config(cls, cfg: StepConfig) -> StepConfig:
        second = cfg.with_process(cfg.process.model_copy(deep=True))
        second.process.recaption.prompt = cfg.process.recaption.second_prompt
        return second

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        # the recaption step records the section (second_prompt included) and its sources
        return Requirements(display=cfg.process.recaption.model)

    @classmethod
    def manifest_entries(cls, cfg: StepConfig, first: dict[str, Any],
                         totals: dict[str, Any]) -> dict[str, Any]:
        return {}
