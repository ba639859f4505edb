"""The recaption step: backends, cleaning, the cache, grounding and the caption choice.

Models are real and tiny (DESIGN.md section 8): BLIP and GIT built from configs around a
BPE trained on the spot, saved with ``save_pretrained`` and loaded by path. The stage tests
teach a tiny BLIP eight captions for eight downloaded photos, so its generations name
people and objects and the safety checks have something to act on.
"""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from conftest import COCO_CAPTIONS, COCO_IMAGES, download_raw
from openai_server import OpenAIServer
from PIL import Image
from test_process_stage import (  # noqa: F401 - tiny_clip, tiny_vq: session fixtures
    _fresh_out,
    _rows,
    tiny_clip,
    tiny_vq,
)
from tiny_models import fit_captioner, save_tiny_captioner

from pairforge.config import RecaptionConfig, parse_config
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.process import run_process
from pairforge.recaption.backends import OpenAICaptioner, TransformersCaptioner, data_url
from pairforge.recaption.cache import CachedCaption, CaptionCache, mentions_text
from pairforge.recaption.choice import training_caption
from pairforge.recaption.grounding import NounLexicon
from pairforge.recaption.prompts import clean_caption

TAUGHT = ["A young woman holding an umbrella next to a dog.",
          "Two boys riding bicycles on a road.",
          "A plate of food with a fork and a knife.",
          "A red bus parked on the street.",
          "An elderly man sitting on a bench in a park.",
          "A cat sleeping on a bed.",
          "A train at the station.",
          "A pizza on a table."]
DUPLICATED = [0, 1, 2]  # these photos appear twice in the input list


def _coco_captions() -> list[str]:
    with open(COCO_CAPTIONS, newline="") as f:
        return [r["caption"] for r in csv.DictReader(f)]


def _photos(n: int) -> list[Image.Image]:
    return [Image.open(p).convert("RGB") for p in sorted(COCO_IMAGES.glob("*.jpg"))[:n]]


@pytest.fixture(scope="session")
def tiny_captioners(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("captioners")
    return {arch: save_tiny_captioner(arch, root / arch, _coco_captions(),
                                      resolution=64 if arch == "idefics3" else 32)
            for arch in ("blip", "git", "idefics3")}


# -- cleaning, choice, nouns, cache: pure functions -------------------------------------------

@pytest.mark.parametrize(("raw", "clean"), [
    ("The image shows a red bus parked on a street. It is sunny.", "A red bus parked on a street."),
    ("This is a picture of two dogs", "Two dogs."),
    ("In this image, we can see a cat on a sofa", "A cat on a sofa."),
    ("A close-up photo of a keyboard.", "A keyboard."),
    ("The photo depicts: a kitchen with a stove", "A kitchen with a stove."),
    ("The scene is calm.", "The scene is calm."),
    ("A black and white photo of a train station", "A black and white photo of a train station."),
    ("\x0c\ufffd ?? ", ""),
])
def test_clean_caption(raw: str, clean: str) -> None:
    assert clean_caption(raw) == clean


def test_prefix_prompt_echo_is_removed() -> None:
    assert clean_caption("a photo of a dog on grass", prompt="a photo of") == "A dog on grass."


def test_training_caption_choice() -> None:
    assert training_caption("recaption", 1, 0, "k", "alt", "re") == ("re", "recaption")
    assert training_caption("recaption", 1, 0, "k", "alt", None) == (None, None)
    assert training_caption("original", 1, 0, "k", "alt", None) == ("alt", "original")
    keys = [f"{i:09d}" for i in range(4000)]
    sources = [training_caption("mix", 0.95, 7, k, "alt", "re")[1] for k in keys]
    assert abs(sources.count("recaption") / len(keys) - 0.95) < 0.015
    again = [training_caption("mix", 0.95, 7, k, "alt", "re")[1] for k in keys]
    assert sources == again  # seeded per key: the same on every worker and rerun
    other_seed = [training_caption("mix", 0.95, 8, k, "alt", "re")[1] for k in keys]
    assert sources != other_seed


def test_noun_lexicon_phrases_plurals_and_extensions(tmp_path: Path) -> None:
    lexicon = NounLexicon()
    assert lexicon.nouns("Two dogs near a fire hydrant and three buses.") == [
        "dog", "fire hydrant", "bus"]
    assert lexicon.nouns("Knives, forks and a teddy bear; people and a person.") == [
        "knife", "fork", "teddy bear"]
    assert lexicon.nouns("A firework over the hotdog stand.") == []
    extra = tmp_path / "nouns.txt"
    extra.write_text("# mine\nhotdog stand\nfirework\n")
    assert NounLexicon([str(extra)]).nouns("A firework over the hotdog stand.") == [
        "firework", "hotdog stand"]


def test_cache_lookup_exact_near_and_text() -> None:
    cache = CaptionCache(phash_distance=2)
    cache.add("a" * 32, 0b1011, CachedCaption("A dog.", ()))
    cache.add("b" * 32, 1 << 40, CachedCaption("A stop sign.", ()))
    cache.add("c" * 32, 1 << 60, CachedCaption(None, ("abstained:empty",)))
    assert cache.lookup("a" * 32, None) == (CachedCaption("A dog.", ()), "cache")
    assert cache.lookup("x" * 32, 0b1000)[1] == "cache_phash"  # distance 2
    assert cache.lookup("x" * 32, 0b0100) is None  # distance 4
    assert cache.lookup("x" * 32, 1 << 40) is None  # mentions text: exact pixels only
    assert cache.lookup("x" * 32, 1 << 60) is None  # an abstention: exact pixels only
    assert cache.lookup("c" * 32, 1 << 60)[0].recaption is None
    assert mentions_text("A stop sign.") and not mentions_text("A dog on grass.")
    assert CaptionCache(0).lookup("x" * 32, 0b1011) is None


# -- backends ------------------------------------------------------------------------------

MODEL_CLASSES = {"blip": "BlipForConditionalGeneration", "git": "GitForCausalLM",
                 "idefics3": "Idefics3ForConditionalGeneration"}


@pytest.mark.parametrize("arch", ["blip", "git"])
def test_transformers_backend_batches_like_single_images(arch, tiny_captioners) -> None:
    cfg = RecaptionConfig(model=str(tiny_captioners[arch]), max_new_tokens=8)
    captioner = TransformersCaptioner(cfg)
    assert type(captioner.model).__name__ == MODEL_CLASSES[arch]
    assert captioner.mode == "none"  # no chat template: unconditional captioning
    images = _photos(4)
    batched = captioner.generate(images, "ignored without a chat template")
    assert batched == [captioner.generate([im], "x")[0] for im in images]
    assert all(isinstance(t, str) and t for t in batched)
    prefixed = TransformersCaptioner(cfg.model_copy(update={"prompt_mode": "prefix"}))
    assert prefixed.generate(images[:2], "a photo of") == [
        prefixed.generate([im], "a photo of")[0] for im in images[:2]]


def test_chat_model_takes_the_prompt_through_its_template(tiny_captioners) -> None:
    """Idefics3 (SmolVLM's architecture): chat template, left padding, prompt dropped."""
    captioner = TransformersCaptioner(RecaptionConfig(model=str(tiny_captioners["idefics3"]),
                                                      max_new_tokens=8))
    assert type(captioner.model).__name__ == MODEL_CLASSES["idefics3"]
    assert captioner.mode == "chat"
    images = _photos(4)
    prompt = "Describe the image."
    batched = captioner.generate(images, prompt)
    assert batched == [captioner.generate([im], prompt)[0] for im in images]
    assert all("Assistant" not in t and "User" not in t for t in batched)
    inputs = captioner._inputs(images[:1], prompt)
    text = captioner.processor.batch_decode(inputs["input_ids"])[0]
    assert prompt in text and text.endswith("Assistant:")


def test_openai_backend_returns_the_served_models_generations(tiny_captioners) -> None:
    served = TransformersCaptioner(RecaptionConfig(model=str(tiny_captioners["git"]),
                                                   max_new_tokens=8))
    images = _photos(6)
    with OpenAIServer(["tiny-git"], served, fail_first=2) as server:
        client = OpenAICaptioner(RecaptionConfig(
            backend="openai", model="tiny-git", max_new_tokens=8,
            openai={"base_url": server.base_url, "concurrency": 3, "retries": 3,
                    "timeout_s": 30}))
        answers = client.generate(images, "Describe the image.")
        assert server.completions == len(images) + 2  # two 503s retried
        assert 1 <= server.max_in_flight <= 3
    # what the server's model says about the very pixels it received (JPEG in a data URL)
    received = [Image.open(io.BytesIO(base64.b64decode(data_url(im).split(",")[1])))
                for im in images]
    assert answers == [served.generate([im.convert("RGB")], "x")[0] for im in received]


def test_openai_backend_reports_a_wrong_model_name(tiny_captioners) -> None:
    from pairforge.recaption.openai_client import ServerRefused

    served = TransformersCaptioner(RecaptionConfig(model=str(tiny_captioners["git"])))
    with OpenAIServer(["tiny-git"], served) as server:
        client = OpenAICaptioner(RecaptionConfig(
            backend="openai", model="other", openai={"base_url": server.base_url}))
        with pytest.raises(ServerRefused, match="404"):
            client.generate(_photos(1), "x")


# -- the step inside stage 3 ----------------------------------------------------------------

@pytest.fixture(scope="session")
def recaption_raw(tmp_path_factory, coco_server, ray_local) -> Path:
    """Raw shards of 8 photos, 3 of them listed twice (identical pixels), and one 404."""
    names = [p.name for p in sorted(COCO_IMAGES.glob("*.jpg"))[:len(TAUGHT)]]
    rows = [(coco_server.url("/img/" + n), f"alt text number {i}") for i, n in enumerate(names)]
    rows += [(rows[i][0], f"another alt text {i}") for i in DUPLICATED]
    rows.append((coco_server.url("/status/404"), "gone for good"))
    return download_raw(tmp_path_factory.mktemp("recaption_raw"), rows, shard_size=6)


def _raw_images(raw_out: Path) -> dict[str, Image.Image]:
    images = {}
    for tar in sorted((raw_out / "raw").glob("*.tar")):
        for sample in wds.WebDataset(str(tar), shardshuffle=False).decode("pil"):
            images[sample["__key__"]] = sample["jpg"].convert("RGB")
    return images


@pytest.fixture(scope="session")
def taught_blip(tmp_path_factory, recaption_raw) -> Path:
    """A tiny BLIP taught TAUGHT[i] for the i-th downloaded photo."""
    images = _raw_images(recaption_raw)
    first = [images[k] for k in sorted(images)][:len(TAUGHT)]
    folder = save_tiny_captioner("blip", tmp_path_factory.mktemp("taught") / "blip",
                                 TAUGHT + _coco_captions())
    return fit_captioner(folder, first, TAUGHT, steps=100)


def _config(out: Path, blip: Path, clip: dict, vq: str, **recaption) -> dict:
    return {"input": {"path": "unused"},
            "output": {"path": str(out)},
            "ray": {"num_cpus": 2},
            "dedup": {"enabled": False},  # let the duplicates reach the recaption step
            "process": {
                "basic": {"min_image_side": 0, "min_caption_words": 0},
                "clip": {**clip, "enabled": True, "mode": "score_only", "batch_size": 8},
                "recaption": {"enabled": True, "model": str(blip), "batch_size": 4,
                              "max_new_tokens": 24, **recaption},
                "tokenize": {"enabled": True, "image": {"path_or_id": vq}},
                "tasks": {"p_drop": 0.25}}}


def _samples(out: Path) -> dict[str, dict]:
    urls = [str(p) for p in sorted((out / "shards").glob("*.tar"))]
    return {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False)}


def test_recaption_stage_caches_dedups_filters_and_chooses(
        tmp_path, recaption_raw, taught_blip, tiny_clip, tiny_vq) -> None:  # noqa: F811
    shared_cache = tmp_path / "cache"
    # the taught model says "woman"; the post-filter's rewrite is what this test reads
    # (constrained decoding has its own tests in test_constrain.py)
    cfg = _config(_fresh_out(tmp_path / "a", recaption_raw), taught_blip, tiny_clip, tiny_vq,
                  cache={"path": str(shared_cache)}, grounding={"min_score": -1.0},
                  constrained_decoding=False)
    cfg["process"]["tasks"].update(caption="mix", recaption_share=0.5)
    out = Path(cfg["output"]["path"])
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    rows = _rows(out)
    assert len(rows) == len(TAUGHT) + len(DUPLICATED) + 1
    ok = {k: r for k, r in rows.items() if r["status"] == "ok"}
    assert len(ok) == len(TAUGHT) + len(DUPLICATED)
    by_url: dict[str, list[dict]] = {}
    for row in ok.values():
        by_url.setdefault(row["url"], []).append(row)
    first = {row["url"]: row for row in sorted(ok.values(), key=lambda r: r["key"])[::-1]}
    # the taught captions, with people's inferred attributes rewritten away
    woman = first[min(by_url, key=lambda u: min(r["key"] for r in by_url[u]))]
    assert woman["recaption"] == "A person holding an umbrella next to a dog."
    assert {"attribute:gender:woman", "attribute:age:young"} <= set(woman["recaption_flags"])
    recaptions = sorted(r["recaption"] for r in first.values())
    assert "A plate of food with a fork and a knife." in recaptions
    assert all("woman" not in r and " man " not in r and "boys" not in r for r in recaptions)
    # duplicates were captioned once: 8 model generations, 3 copies within the build
    origins = [r["recaption_origin"] for r in ok.values()]
    assert origins.count("model") == len(TAUGHT) and origins.count("build") == len(DUPLICATED)
    for copies in by_url.values():
        assert len({r["recaption"] for r in copies}) == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recaption"]["origin"] == {"build": 3, "model": 8}
    assert manifest["recaption"]["rows_with_attributes_removed"] >= 3
    # the seeded mix decides each sample's training caption; the tar trains on it
    samples = _samples(out)
    for key, row in ok.items():
        text, source = training_caption("mix", 0.5, 0, key, row["caption"], row["recaption"])
        assert (row["caption_source"], row["train_caption"]) == (source, text)
        assert samples[key]["txt"].decode() == text
        meta = json.loads(samples[key]["json"])
        assert meta["caption_source"] == source and meta["recaption"] == row["recaption"]
        tokens = np.load(io.BytesIO(samples[key]["tok.npy"]))
        assert bytes(tokens.astype(np.uint8)).decode() == text  # the byte tokenizer
    assert {r["caption_source"] for r in ok.values()} == {"recaption", "original"}

    # a second build over the same inputs, sharing the cache: no generation at all, and no
    # captioner loaded (its weights are garbage for the run: preflight sees the file, a
    # load would fail)
    again = _config(_fresh_out(tmp_path / "b", recaption_raw), taught_blip, tiny_clip, tiny_vq,
                    cache={"path": str(shared_cache)}, grounding={"min_score": -1.0},
                    constrained_decoding=False)  # the same settings, or the cache misses
    out_b = Path(again["output"]["path"])
    weights = taught_blip / "model.safetensors"
    hidden = weights.rename(tmp_path / "weights.hidden")
    weights.write_bytes(b"not a safetensors file")
    try:
        run_process(parse_config(again), RunOptions(show_progress=False))
    finally:
        hidden.replace(weights)
    second = _rows(out_b)
    assert [r["recaption_origin"] for r in second.values() if r["status"] == "ok"] == [
        "cache"] * len(ok)
    assert {k: r["recaption"] for k, r in second.items()} == {
        k: r["recaption"] for k, r in rows.items()}
    stats = json.loads((out_b / "manifest.json").read_text())["recaption"]
    assert stats["origin"] == {"cache": len(ok)}


def test_unsupported_nouns_regenerate_then_abstain_to_img(
        tmp_path, recaption_raw, taught_blip, tiny_clip, tiny_vq) -> None:  # noqa: F811
    """Through the OpenAI-compatible backend: a server on 127.0.0.1 serves the taught BLIP."""
    from pairforge.recaption.prompts import DEFAULT_PROMPT, STRICT_PROMPT

    served = TransformersCaptioner(RecaptionConfig(model=str(taught_blip), max_new_tokens=24))
    with OpenAIServer(["taught-blip"], served) as server:
        # no noun can reach a cosine similarity of 1.5: every caption naming an object fails
        cfg = _config(_fresh_out(tmp_path, recaption_raw), taught_blip, tiny_clip, tiny_vq,
                      cache={"enabled": False}, grounding={"min_score": 1.5})
        cfg["process"]["recaption"].update(
            backend="openai", model="taught-blip",
            openai={"base_url": server.base_url, "concurrency": 2})
        out = Path(cfg["output"]["path"])
        run_process(parse_config(cfg), RunOptions(show_progress=False))
    # each distinct photo asked twice (the strict retry), its duplicates not at all
    assert server.prompts == {DEFAULT_PROMPT: len(TAUGHT),
                              DEFAULT_PROMPT + STRICT_PROMPT: len(TAUGHT)}
    ok = [r for r in _rows(out).values() if r["status"] == "ok"]
    assert len(ok) == len(TAUGHT) + len(DUPLICATED)
    assert all(r["recaption"] is None for r in ok)
    for row in ok:
        flags = row["recaption_flags"]
        assert any(f.startswith("regenerated:ungrounded:") for f in flags)
        assert any(f.startswith("abstained:ungrounded:") for f in flags)
        assert row["task"] == "img" and row["caption_source"] is None
        assert row["n_caption_tokens"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recaption"]["abstained"] == len(ok)
    # one flag per unsupported noun: the taught captions name one to three objects each
    assert manifest["recaption"]["flags"]["abstained:ungrounded"] >= len(ok)
    assert set(manifest["totals"]["tasks"]) == {"img"}


@pytest.mark.parametrize("dedup", [True, False])
def test_a_claim_registry_only_where_copies_can_reach_stage_3(ray_local, dedup):
    """With dedup on, stage 2 dropped every pixel-identical copy: no registry actor (it
    would hold every pixel hash and caption of the build); with dedup off, one."""
    from pairforge.pipeline.contract import step_config
    from pairforge.recaption.claims import find_registry
    from pairforge.recaption.step import RecaptionStep, registry_name

    cfg = step_config(parse_config({"input": {"path": "unused"}, "dedup": {"enabled": dedup},
                                    "process": {"recaption": {"enabled": True,
                                                              "model": "unused"}}}))
    with RecaptionStep.build_scope(cfg, rows=10_000):
        registry = find_registry(registry_name(cfg))
        assert (registry is not None) == (not dedup)
        assert dedup or len(registry.actors) == 1  # a small run: one actor, not 16


def test_clip_grounding_reads_the_clip_steps_image_vectors(
        recaption_raw, tiny_captioners, tiny_clip, ray_local, monkeypatch) -> None:  # noqa: F811
    """Each image goes through CLIP's image tower once: the clip step keeps the vectors of
    the rows it scores, and clip grounding reads them instead of encoding the images
    again (issue 48). The same captions and flags as when grounding encodes them itself."""
    import pyarrow as pa

    from pairforge.filters.clip import ClipScorer, ClipStep
    from pairforge.pipeline.contract import step_config
    from pairforge.pipeline.stream import load_rows
    from pairforge.recaption.step import RecaptionStep

    class NoDuplicates:
        def of_shard(self, shard_id: int) -> set[str]:
            return set()

    encoded: list[int] = []

    def counting(real):  # noqa: ANN001, ANN202 - the decoded images' path and the views'
        def count(self, images):  # noqa: ANN001, ANN202
            encoded.append(len(images))
            return real(self, images)
        return count

    monkeypatch.setattr(ClipScorer, "embed_images", counting(ClipScorer.embed_images))
    monkeypatch.setattr(ClipScorer, "embed_view", counting(ClipScorer.embed_view))
    cfg = step_config(parse_config(_config(
        recaption_raw, tiny_captioners["blip"], tiny_clip, "unused",
        cache={"enabled": False}, grounding={"min_score": -1.0})))
    rows = load_rows(pa.table({"shard": [0, 1]}), str(recaption_raw), {}, NoDuplicates())
    scored = ClipStep(cfg)(rows)
    assert sum(encoded) == rows.num_rows == len(TAUGHT) + len(DUPLICATED)
    recaption = RecaptionStep(cfg)
    captioned = recaption(scored)
    assert sum(encoded) == rows.num_rows  # grounding encoded nothing
    assert recaption.checked.grounding.uses_clip_embeddings
    # without the clip step's vectors, grounding encodes every generated row itself
    encoded.clear()
    alone = RecaptionStep(cfg)(scored.drop_columns(["clip_embedding"]))
    generated = sum(o == "model" for o in alone["recaption_origin"].to_pylist())
    assert generated > 0 and sum(encoded) >= generated
    for column in ("recaption", "recaption_flags"):
        assert captioned[column].to_pylist() == alone[column].to_pylist()
