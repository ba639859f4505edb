"""The recaption cache's embedding tier (issue 20): a caption reused for an image whose
image embedding (the captioner's own vision encoder's, or CLIP's) is within a cosine
threshold of a cached one.

Unit level: the cache alone, then the recaption step's ``process``/``finish_shard`` on
real photos with a tiny random-weight BLIP and a tiny open_clip (golden.tiny_clip), run
in this process without Ray (no claim registry: each row is its own claimant).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import COCO_CAPTIONS, COCO_IMAGES
from golden import tiny_clip
from PIL import Image
from tiny_models import save_tiny_captioner

from pairforge.config import parse_config
from pairforge.dedup.hashing import phash_u64, pixel_hash_hex
from pairforge.pipeline.contract import step_config
from pairforge.recaption import step as step_module
from pairforge.recaption.cache import CachedCaption, CaptionCache, cache_dir
from pairforge.recaption.step import RecaptionStep


def _unit(*values: float) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_embedding_tier_answers_after_exact_and_phash() -> None:
    cache = CaptionCache(phash_distance=2, embedding_threshold=0.95)
    cache.add("a" * 32, 0b1011, CachedCaption("A dog.", ()), _unit(1, 0, 0))
    cache.add("b" * 32, 1 << 40, CachedCaption("A stop sign.", ()), _unit(0, 1, 0))
    cache.add("c" * 32, 1 << 60, CachedCaption(None, ("abstained:empty",)), _unit(0, 0, 1))
    assert cache.lookup("a" * 32, None, _unit(0, 0, 1))[1] == "cache"  # exact pixels first
    assert cache.lookup("x" * 32, 0b1000, _unit(0, 0, 1))[1] == "cache_phash"
    near = _unit(1, 0.2, 0)  # cosine 0.981 with the dog's vector
    assert cache.lookup("x" * 32, 1 << 20, near) == (CachedCaption("A dog.", ()),
                                                      "cache_embedding")
    assert cache.lookup("x" * 32, 1 << 20, _unit(1, 0.5, 0)) is None  # cosine 0.894
    # same exclusions as the phash tier: text and abstentions are exact-pixel only
    assert cache.lookup("x" * 32, None, _unit(0, 1, 0)) is None
    assert cache.lookup("x" * 32, None, _unit(0, 0, 1)) is None
    assert len(cache.vectors) == 1
    assert CaptionCache(0).lookup("x" * 32, None, _unit(1, 0, 0)) is None  # tier off


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    with open(COCO_CAPTIONS, newline="") as f:  # a real vocabulary: captions with words
        captions = [r["caption"] for r in csv.DictReader(f)]
    built = {arch: str(save_tiny_captioner(arch, root / arch, captions))
             for arch in ("blip", "git", "idefics3")}
    return {**built, "clip": tiny_clip(root / "clip")}


def _cfg(out: Path, models: dict, threshold: float | None, source: str = "clip",
         captioner: str = "blip"):  # noqa: ANN202
    return parse_config({
        "input": {"path": str(out / "in.csv")}, "output": {"path": str(out)},
        "process": {"clip": models["clip"], "recaption": {
            "enabled": True, "model": models[captioner], "max_new_tokens": 6,
            "grounding": {"enabled": False},
            "cache": {"embedding_threshold": threshold, "embedding_source": source}}}})


def _rows(images: list[Image.Image]) -> pa.Table:
    data = []
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        data.append({"key": f"{i:09d}", "image": buffer.getvalue(), "caption": "alt",
                     "pixel_hash": pixel_hash_hex(image), "phash": phash_u64(image)})
    schema = pa.schema([("key", pa.string()), ("image", pa.binary()), ("caption", pa.string()),
                        ("pixel_hash", pa.string()), ("phash", pa.uint64())])
    return pa.Table.from_pylist(data, schema=schema)


def _run(cfg, table: pa.Table) -> list[dict]:  # noqa: ANN001
    result = RecaptionStep(step_config(cfg)).process(table)
    rows = [dict(zip(result.columns, values, strict=True))
            for values in zip(*result.columns.values(), strict=True)]
    for row, source in zip(rows, table.to_pylist(), strict=True):
        row.update(pixel_hash=source["pixel_hash"], phash=source["phash"])
    RecaptionStep.finish_shard(step_config(cfg), 0, rows)
    return rows


def test_step_reuses_captions_by_clip_embedding(tmp_path, models, monkeypatch) -> None:
    monkeypatch.setattr(step_module, "find_registry", lambda name: None)
    photos = [Image.open(p).convert("RGB") for p in sorted(COCO_IMAGES.glob("*.jpg"))[:3]]
    cfg = _cfg(tmp_path, models, 0.995)
    first = _run(cfg, _rows(photos[:2]))
    assert [r["recaption_origin"] for r in first] == ["model", "model"]
    assert all("recaption_embedding" not in r for r in first)  # popped: cache only
    part = pq.read_table(cache_dir(cfg).path(cache_dir(cfg).glob("*.parquet")[0]))
    assert part.column("embedding").null_count == 0 and len(part) == 2

    # a slightly brighter copy of photo 0: other pixels, but its CLIP embedding is close
    brighter = photos[0].point(lambda v: min(255, v + 3))
    second = _run(cfg, _rows([brighter, photos[2]]))
    assert [r["recaption_origin"] for r in second] == ["cache_embedding", "model"]
    assert second[0]["recaption"] == first[0]["recaption"]

    # the tier is part of the cache identity: without it a build does not reuse by vector
    plain = _cfg(tmp_path, models, None)
    assert cache_dir(plain).path("") != cache_dir(cfg).path("")
    assert [r["recaption_origin"] for r in _run(plain, _rows([brighter]))] == ["model"]


@pytest.mark.parametrize(("arch", "encoder"), [("blip", "BlipVisionModel"),
                                               ("git", "GitVisionModel"),
                                               ("idefics3", "get_image_features")])
def test_captioner_vectors_come_from_its_own_encoder(tmp_path, models, arch, encoder) -> None:
    """BLIP's vision_model, GIT's image_encoder, Idefics3's get_image_features (after the
    projector): one unit vector per image, the same whether batched or alone."""
    from pairforge.recaption.backends import TransformersCaptioner

    captioner = TransformersCaptioner(_cfg(tmp_path, models, 0.9, "captioner", arch)
                                      .process.recaption)
    found = captioner.vision.encoder
    assert getattr(found, "__name__", type(found).__name__) == encoder
    photos = [Image.open(p).convert("RGB") for p in sorted(COCO_IMAGES.glob("*.jpg"))[:3]]
    vectors = captioner.image_embeddings(photos)
    assert vectors.shape == (3, 32) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(captioner.image_embeddings(photos[1:2])[0], vectors[1],
                               atol=1e-5)
    assert float(vectors[0] @ vectors[2]) < 0.9999  # other photos, other vectors


def test_step_reuses_captions_by_the_captioners_embedding(tmp_path, models,
                                                         monkeypatch) -> None:
    """auto with the transformers backend: the captioner's own vectors are cached and
    compared; the clip model is never loaded."""
    from pairforge.recaption import checked

    def no_clip(*args: object) -> None:
        raise AssertionError("the captioner's embedding tier loaded CLIP")

    monkeypatch.setattr(step_module, "find_registry", lambda name: None)
    monkeypatch.setattr(checked, "ClipScorer", no_clip)
    photos = [Image.open(p).convert("RGB") for p in sorted(COCO_IMAGES.glob("*.jpg"))[:3]]
    # the tiny BLIP (random weights, 32 px): the brighter copy 0.95, other photos <= 0.4
    cfg = _cfg(tmp_path, models, 0.9, "auto")
    assert cfg.process.recaption.embedding_source == "captioner"
    table = _rows(photos[:2])
    step = RecaptionStep(step_config(cfg))
    decoded = [Image.open(io.BytesIO(b)).convert("RGB") for b in table["image"].to_pylist()]
    expected = step.checked.captioner.image_embeddings(decoded)
    first = _run(cfg, table)
    assert [r["recaption_origin"] for r in first] == ["model", "model"]
    part = pq.read_table(cache_dir(cfg).path(cache_dir(cfg).glob("*.parquet")[0]))
    np.testing.assert_allclose(np.asarray(part.column("embedding").to_pylist()), expected,
                               atol=1e-5)

    brighter = photos[0].point(lambda v: min(255, v + 3))
    second = _run(cfg, _rows([brighter, photos[2]]))
    assert [r["recaption_origin"] for r in second] == ["cache_embedding", "model"]
    assert second[0]["recaption"] == first[0]["recaption"]
    # whose vectors they are is part of the cache identity
    assert cache_dir(_cfg(tmp_path, models, 0.9, "clip")).path("") != cache_dir(cfg).path("")


def test_a_served_captioner_compares_clip_vectors(tmp_path, models) -> None:
    served = {"input": {"path": "in.csv"}, "output": {"path": str(tmp_path)},
              "process": {"recaption": {"enabled": True, "backend": "openai",
                                        "model": "served",
                                        "cache": {"embedding_threshold": 0.97}}}}
    assert parse_config(served).process.recaption.embedding_source == "clip"
    served["process"]["recaption"]["cache"]["embedding_source"] = "captioner"
    with pytest.raises(ValueError, match="embedding_source: captioner needs the transformers"):
        parse_config(served)


@pytest.mark.parametrize("arch", ["blip", "git", "idefics3"])
def test_a_miss_reuses_the_towers_output(tmp_path, models, arch) -> None:
    """After the lookup's vectors, ``generate`` on the same pixels reads the tower's
    outputs from the memo (no second forward) and writes the same captions as a model
    without one; other pixels run the tower."""
    from pairforge.recaption.backends import TransformersCaptioner
    from pairforge.recaption.vision import find_tower

    def load() -> TransformersCaptioner:
        return TransformersCaptioner(_cfg(tmp_path, models, 0.9, "captioner", arch)
                                     .process.recaption)

    captioner = load()
    tower, runs = find_tower(captioner.model), []
    forward = tower.forward
    tower.forward = lambda *a, **k: runs.append(1) or forward(*a, **k)
    photos = [Image.open(p).convert("RGB") for p in sorted(COCO_IMAGES.glob("*.jpg"))[:4]]
    captioner.image_embeddings(photos[:3])
    assert len(runs) == 1
    captions = captioner.generate(photos[2::-1], "")  # any order, any subset
    assert len(runs) == 1
    assert captions == load().generate(photos[2::-1], "")
    captioner.generate(photos[1:], "")  # photo 3 was never embedded
    assert len(runs) > 1
