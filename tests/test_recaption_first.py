"""Recaption-first builds (issue 35): junk alt-text decides nothing; the checks judge the
training caption after recaptioning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
import yaml
from golden import tiny_clip
from loopback_server import LoopbackServer

from pairforge.config import BasicFilterConfig, ConfigError, load_config
from pairforge.download.alt_text import (
    BOILERPLATE,
    EMPTY,
    FILE_NAME,
    NOT_UTF8,
    invalid_error,
    junk_kind,
    read_alt_text,
)
from pairforge.filters.clip import ClipCandidatesStep, ClipScorer, ClipStep, ClipTrainingStep
from pairforge.images import decode_rgb
from pairforge.inspection.report import render_report
from pairforge.pipeline.contract import step_config
from pairforge.recaption.choice import Choice, TrainingCaptionStep, recaption_first_choice
from pairforge.records import Status
from pairforge.scenes.world import render, scenes

SAMPLE = Path(__file__).resolve().parents[1] / "pairforge" / "sample"


@pytest.mark.parametrize("text", ["IMG_0001.jpg", "DSC1234.JPG", "image-0042.png",
                                  "upload_0001.jpeg", "photo0001.jpg", "DSC_0042", "20190301_1215",
                                  "3f2a9c1b7e4d", "my holiday.webp"])
def test_file_names_are_junk(text: str) -> None:
    assert junk_kind(text) == FILE_NAME


@pytest.mark.parametrize("text", ["image", "Photo", "untitled", "Click here!", "stock image",
                                  "img", "thumbnail", "Image 3", "photo #12", "N/A"])
def test_boilerplate_is_junk(text: str) -> None:
    assert junk_kind(text) == BOILERPLATE


@pytest.mark.parametrize("text", ["A small red circle on the left on a grey background.",
                                  "photo of a dog on a beach", "Image of the Eiffel tower",
                                  "red", "2 cats", "jpg artefacts explained"])
def test_real_alt_text_is_not_junk(text: str) -> None:
    assert junk_kind(text) is None


def test_what_stage_1_records_and_when_it_ends_the_row() -> None:
    assert read_alt_text(b"  ").issue == EMPTY
    assert read_alt_text(b"caf\xe9").issue == NOT_UTF8
    junk = read_alt_text(b" IMG_0001.jpg ")
    assert (junk.text, junk.issue) == ("IMG_0001.jpg", FILE_NAME)
    # alt-text-first: as always (unreadable ends the row where captions are read)
    assert invalid_error(read_alt_text(b""), True, False) == "empty caption"
    assert invalid_error(read_alt_text(None), True, False) == "missing caption"
    assert invalid_error(read_alt_text(None), False, False) is None
    assert invalid_error(read_alt_text(b"caf\xe9"), False, False).startswith("caption is not")
    assert invalid_error(junk, True, False) is None  # stage 3's caption rules judge it
    # recaption-first: nothing ends a row
    for raw in (b"", None, b"caf\xe9", b"IMG_0001.jpg"):
        assert invalid_error(read_alt_text(raw), True, True) is None


RULES = BasicFilterConfig(min_caption_words=2, min_caption_chars=5)


@pytest.mark.parametrize(("choice", "original", "issue", "recaption", "expected"), [
    ("recaption", "a red ball", None, "a blue cube", Choice("a blue cube", "recaption")),
    # the recaption abstained on an image with usable alt-text: an img sample, as always
    ("recaption", "a red ball", None, None, Choice()),
    ("recaption", "ball", None, None, Choice()),  # the alt-text is not judged: not trained
    # ... without usable alt-text: the row has no caption at all
    ("recaption", "IMG_1.jpg", "file_name", None,
     Choice(status=Status.CAPTION_ABSTAINED,
            error="the captioner abstained and the alt-text is file_name")),
    ("recaption", None, "empty", "a blue cube", Choice("a blue cube", "recaption")),
    # the caption rules judge the training caption
    ("recaption", "a red ball", None, "cube",
     Choice(status=Status.CAPTION_TOO_SHORT, error="recaption: 1 words, 4 characters")),
    # mix: the draw (here the recaption, share 1), else the other
    ("mix", "a red ball", None, "cube", Choice("a red ball", "original")),
    ("mix", "a red ball", None, None, Choice("a red ball", "original")),
    ("mix", "ball", None, "cube",
     Choice(status=Status.CAPTION_TOO_SHORT, error="recaption: 1 words, 4 characters")),
    ("mix", None, "empty", None,
     Choice(status=Status.CAPTION_ABSTAINED,
            error="the captioner abstained and the alt-text is empty")),
])
def test_the_recaption_first_choice(choice, original, issue, recaption, expected) -> None:
    candidates = {"recaption": recaption, "original": original}
    assert recaption_first_choice(choice, 1.0, 0, "000000001", candidates, issue,
                                  RULES) == expected


def test_mix_tries_its_draw_first_then_the_other() -> None:
    keys = [f"{i:09d}" for i in range(400)]
    both = {"recaption": "a blue cube", "original": "a red ball"}
    drawn = [recaption_first_choice("mix", 0.5, 3, k, both, None, RULES).source for k in keys]
    assert 150 < drawn.count("original") < 250  # the seeded draw, both sources used
    # where the draw is the alt-text but it is junk, the recaption trains: no row is lost
    junk = [recaption_first_choice("mix", 0.5, 3, k, {**both, "original": "IMG_1.jpg"},
                                   "file_name", RULES).source for k in keys]
    assert junk == ["recaption"] * len(keys)


def test_top_fraction_cannot_judge_the_training_caption(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "input": {"path": "in.csv"}, "output": {"path": "out"},
        "process": {"clip": {"enabled": True, "mode": "top_fraction"},
                    "recaption": {"enabled": True}}}))
    with pytest.raises(ConfigError, match="clip.score: original"):
        load_config(path)
    config = yaml.safe_load(path.read_text())
    config["process"]["clip"]["score"] = "original"
    path.write_text(yaml.safe_dump(config))
    assert load_config(path).process.recaption_first()


def _png(image) -> bytes:  # noqa: ANN001
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("score", "choice"), [("training", "recaption"), ("both", "recaption"),
                                               ("original", "recaption"), ("training", "best"),
                                               ("original", "best")])
def test_clip_judges_the_caption_clip_score_names(tmp_path: Path, score: str,
                                                  choice: str) -> None:
    """The clip steps' scores are the bare open_clip cosine of the image and the caption
    clip.score names, computed in a plain loop with the same model; ``best`` trains on the
    argmax of those scores over the candidates the caption rules pass."""
    clip = tiny_clip(tmp_path / "clip")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "input": {"path": "in.csv"}, "output": {"path": "out"},
        "process": {"clip": {"enabled": True, "threshold": -1.0, "score": score, **clip},
                    "recaption": {"enabled": True, "model": str(SAMPLE / "captioner"),
                                  "second_prompt": "Describe the image in detail."},
                    "tasks": {"caption": choice}}}))
    cfg = step_config(load_config(config))
    drawn = scenes(6)
    images = [_png(render(s, 32)) for s in drawn]
    candidates = {
        "recaption": ["a large red circle", None, "a small blue cross", "two green squares",
                      "a purple cross", "a white circle"],
        "recaption_2": ["a red circle on grey", "a square at the top", None,
                        "two squares side by side", "a cross on black", "circle"],
        "original": ["a red circle", "a square", "IMG_3.jpg", None, "one shape", "blue"]}
    rows = pa.table({
        "key": [f"{i:09d}" for i in range(6)], "image": images,
        "caption": candidates["original"],
        "caption_issue": [None, None, "file_name", "empty", None, None],
        "status": ["ok"] * 6, "error": [None] * 6,
        "recaption": candidates["recaption"], "recaption_2": candidates["recaption_2"]})
    for step in (ClipStep, ClipCandidatesStep, TrainingCaptionStep, ClipTrainingStep):
        if step.enabled(cfg):
            rows = step(cfg)(rows)
    scorer = ClipScorer(cfg.process.clip)

    def bare(texts: list[str | None]) -> list[float | None]:
        out: list[float | None] = []
        for image, text in zip(images, texts, strict=True):
            if text is None:
                out.append(None)
                continue
            sim, _ = scorer.score([decode_rgb(image)], [text])
            out.append(float(sim[0]))
        return out

    usable = ["a red circle", "a square", None, None, "one shape", "blue"]
    sources = rows["caption_source"].to_pylist()
    if choice == "best":  # the argmax of the bare scores over the candidates the rules pass
        scores = {"recaption": bare(candidates["recaption"]),
                  "recaption_2": bare(candidates["recaption_2"]), "original": bare(usable)}
        texts = {**candidates, "original": usable}
        expected = []
        for i in range(6):
            passing = {s: scores[s][i] for s in scores if texts[s][i] is not None
                       and len(texts[s][i].split()) >= 2 and len(texts[s][i]) >= 5}
            expected.append(max(passing, key=passing.get))
        assert sources == expected
        assert len(set(expected)) >= 2  # not one source throughout: the scores decided
    else:  # row 1: the recaption abstained on an image with usable alt-text: an img sample
        assert sources == ["recaption", None, "recaption", "recaption", "recaption",
                           "recaption"]
    train = rows["train_caption"].to_pylist()
    judged = bare(usable) if score == "original" else bare(train)
    np.testing.assert_allclose(np.array(rows["clip_score"].to_pylist(), dtype=float),
                               np.array(judged, dtype=float), atol=1e-5)
    recorded = score == "both" or choice == "best"
    originals = bare(usable) if recorded else [None] * 6
    np.testing.assert_allclose(np.array(_or_nulls(rows, "clip_score_original"), dtype=float),
                               np.array(originals, dtype=float), atol=1e-5)


def _or_nulls(rows: pa.Table, column: str) -> list:
    return rows[column].to_pylist() if column in rows.column_names else [None] * rows.num_rows


def _junk_alt_text_build(tmp_path: Path, env: dict[str, str], recaption: bool, n: int = 100,
                         alt_text: Any = None, process_settings: dict | None = None,
                         shard_size: int = 50) -> Path:
    """``n`` scene-world images over loopback, in shards of ``shard_size``; alt-text
    (``alt_text(i, scene)``) half empty, half camera file names by default; the demo's
    captioner, tokenizer and p_drop, and ``process_settings``. The build joins this
    worker's Ray (``env``: conftest's ``ray_env``)."""
    folder = tmp_path / "images"
    folder.mkdir()
    drawn = scenes(n)
    for i, s in enumerate(drawn):
        render(s, 32).save(folder / f"scene_{i:03d}.png")
    alt_text = alt_text or (lambda i, s: "" if i % 2 else f"IMG_{i:04d}.jpg")
    with LoopbackServer(folder) as server:
        lines = [f"{server.url(f'/img/scene_{i:03d}.png')},{alt_text(i, s)}"
                 for i, s in enumerate(drawn)]
        (tmp_path / "in.csv").write_text("url,caption\n" + "\n".join(lines) + "\n")
        demo = yaml.safe_load((SAMPLE.parents[1] / "examples" / "demo.yaml").read_text())
        process = demo["process"]
        process["recaption"]["enabled"] = recaption
        for section in ("image", "text"):
            tokenizer = process["tokenize"][section]
            tokenizer["path_or_id"] = str(SAMPLE.parents[1] / tokenizer["path_or_id"])
        process["recaption"]["model"] = str(SAMPLE / "captioner")
        # what recaptioning does with junk alt-text, alone: the demo's world-CLIP filter,
        # watermark classifier and grounding (which may end rows) only where asked
        process.pop("clip", None)
        process.pop("classifiers", None)
        process["recaption"]["grounding"] = {"enabled": False}
        for section, values in (process_settings or {}).items():
            process.setdefault(section, {}).update(values)
        cfg = {**demo, "input": {"path": str(tmp_path / "in.csv"), "shard_size": shard_size},
               "output": {"path": str(tmp_path / "out")},
               "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
               "dedup": {"enabled": False}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                                 str(tmp_path / "c.yaml"), "-q"], capture_output=True,
                                text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    return tmp_path / "out"


def _rows(out: Path) -> list[dict]:
    return pq.read_table(sorted((out / "shards").glob("*.parquet"))).to_pylist()


def test_a_recaptioning_build_keeps_every_image_whose_alt_text_is_junk(
        tmp_path: Path, ray_env: dict[str, str]) -> None:
    out = _junk_alt_text_build(tmp_path, ray_env, recaption=True)
    rows = _rows(out)
    statuses = [r["status"] for r in rows]
    assert len(rows) == 100 and statuses.count("ok") >= 99
    assert not [s for s in statuses if s.startswith("caption_") and s != "caption_abstained"]
    issues = [r["caption_issue"] for r in rows]
    assert (issues.count("empty"), issues.count("file_name")) == (50, 50)
    kept = [r for r in rows if r["status"] == "ok"]
    assert {r["caption_source"] for r in kept} == {"recaption"}
    assert all(r["train_caption"] == r["recaption"] for r in kept)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recaption"]["rescued"] == len(kept)
    page = render_report(str(out))
    assert f"no usable alt-text, recaptioned</td><td class=\"n\">{len(kept)}</td>" in page
    tars = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    texts = {s["__key__"]: s["txt"].decode() for s in wds.WebDataset(tars, shardshuffle=False)}
    assert texts == {r["key"]: r["train_caption"] for r in kept}


def test_best_of_two_prompts_and_the_alt_text_through_a_build(
        tmp_path: Path, ray_env: dict[str, str]) -> None:
    """A second prompt's recaption and ``best`` through a real build: every row's training
    caption is the passing candidate with the highest CLIP score, and the manifest counts
    which caption trained how many samples."""
    clip = tiny_clip(tmp_path / "clip")
    out = _junk_alt_text_build(
        tmp_path, ray_env, True, n=40, shard_size=100,
        alt_text=lambda i, s: s.sentence if i % 4 else "image",
        process_settings={"clip": {"enabled": True, "threshold": -1.0, **clip},
                          "recaption": {"second_prompt": "a picture of"},
                          "tasks": {"caption": "best"}})
    rows = _rows(out)
    kept = [r for r in rows if r["status"] == "ok"]
    assert len(kept) == 40 and all(r["recaption_2_origin"] for r in kept)
    for r in kept:
        texts = {"recaption": r["recaption"], "recaption_2": r["recaption_2"],
                 "original": r["caption"] if r["caption_issue"] is None else None}
        scores = {s: r[f"clip_score_{s}"] for s, t in texts.items() if t is not None}
        assert r["caption_source"] == max(scores, key=scores.get)
        assert r["train_caption"] == texts[r["caption_source"]]
        assert r["clip_score"] == scores[r["caption_source"]]
    manifest = json.loads((out / "manifest.json").read_text())
    trained = manifest["training_caption"]["samples_by_caption"]
    assert sum(trained.values()) == manifest["totals"]["samples"] == 40
    assert trained == {s: sum(r["caption_source"] == s for r in kept) for s in trained}
    assert manifest["recaption_2"]["rows"] == 40
    # each prompt has its own cache identity
    assert len(list((out / "recaption_cache").iterdir())) == 2


def test_without_recaption_junk_alt_text_ends_rows_as_before(
        tmp_path: Path, ray_env: dict[str, str]) -> None:
    rows = _rows(_junk_alt_text_build(tmp_path, ray_env, recaption=False))
    statuses = [r["status"] for r in rows]
    assert (statuses.count("caption_invalid"), statuses.count("caption_too_short")) == (50, 50)
