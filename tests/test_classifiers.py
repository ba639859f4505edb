"""Image classifiers in stage 3 (pairforge/filters/classify.py): tiny random-weight models
saved in each format the backends load (a transformers image-classification folder with
labels, LAION's aesthetic-predictor state dict, a plain linear head), loaded through the
real loading code, and a build over loopback HTTP on local Ray where thresholds chosen
from a bare loop's scores drop known rows with the right status."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import COCO_CAPTIONS, download_raw
from golden import tiny_clip

from pairforge.config import ConfigError, parse_config

N_IMAGES = 24


def _save_vit(folder: Path, labels: list[str], seed: int) -> str:
    """A tiny ViT image classifier with random weights, saved as transformers saves one."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(seed)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=64,
                       id2label=dict(enumerate(labels)),
                       label2id={name: i for i, name in enumerate(labels)})
    model = ViTForImageClassification(config)
    with torch.no_grad():  # a random head's logits sit near 0; spread them over (0, 1)
        model.classifier.weight.mul_(60)
    model.save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return str(folder)


def _aesthetic_mlp(input_size: int):  # noqa: ANN202 - a torch module
    """LAION's improved aesthetic predictor as published (simple_inference.py's MLP:
    linears with dropouts between and no activations), here over 32-dim embeddings."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16),
                nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    torch.manual_seed(3)
    return MLP().eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    import torch

    folder = tmp_path_factory.mktemp("classifier_models")
    clip = tiny_clip(folder / "clip")  # the golden build's tiny open_clip (embed_dim 32)
    aesthetic = _aesthetic_mlp(32)
    torch.save(aesthetic.state_dict(), folder / "aesthetic.pth")
    torch.manual_seed(4)
    linear = torch.nn.Linear(32, 1)
    torch.save(linear.state_dict(), folder / "linear.pth")
    torch.save(torch.nn.Linear(48, 1).state_dict(), folder / "linear48.pth")
    return {"clip": clip,
            "nsfw": _save_vit(folder / "nsfw", ["normal", "nsfw"], seed=1),
            "watermark": _save_vit(folder / "watermark", ["clean", "watermark", "text"], seed=2),
            "aesthetic": str(folder / "aesthetic.pth"), "aesthetic_module": aesthetic,
            "linear": str(folder / "linear.pth"), "linear_module": linear,
            "linear48": str(folder / "linear48.pth")}


def _cfg(out: Path, models: dict, classifiers: list[dict], **clip) -> dict:
    return {"input": {"path": "unused"}, "output": {"path": str(out)},
            "ray": {"num_cpus": 2}, "dedup": {"enabled": False},
            "process": {"basic": {"min_image_side": 64},
                        "clip": {"enabled": True, "mode": "score_only", "batch_size": 8,
                                 **models["clip"], **clip},
                        "classifiers": classifiers}}


# -- heads ----------------------------------------------------------------------------------

def test_heads_load_in_each_layout_and_match_torch(models, tmp_path):
    import torch
    from safetensors.torch import save_file

    from pairforge.filters.classify import LinearHead, head_layers, read_state_dict

    x = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32)
    for path, module in ((models["aesthetic"], models["aesthetic_module"]),
                         (models["linear"], models["linear_module"])):
        head = LinearHead(head_layers(read_state_dict(path)))
        assert head.input_dim == 32
        with torch.no_grad():
            expected = module(torch.from_numpy(x))[:, 0].numpy()
        np.testing.assert_allclose(head(x), expected, rtol=1e-5, atol=1e-6)
    # a plain nn.Sequential MLP with ReLU and two outputs, as safetensors, softmax of output 1
    torch.manual_seed(5)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    save_file(mlp.state_dict(), str(tmp_path / "mlp.safetensors"))
    head = LinearHead(head_layers(read_state_dict(tmp_path / "mlp.safetensors")), "relu",
                      "softmax", 1)
    with torch.no_grad():
        expected = mlp(torch.from_numpy(x)).softmax(-1)[:, 1].numpy()
    np.testing.assert_allclose(head(x), expected, rtol=1e-5, atol=1e-6)


def test_a_state_dict_of_no_known_layout_is_named():
    from pairforge.filters.classify import head_layers

    with pytest.raises(ValueError, match="not a linear head's state dict.*conv.weight"):
        head_layers({"conv.weight": np.zeros((4, 3, 3, 3)), "fc.0.weight": np.zeros((1, 4))})
    with pytest.raises(ValueError, match="layer 1 takes 5 inputs but layer 0 gives 4"):
        head_layers({"0.weight": np.zeros((4, 8)), "1.weight": np.zeros((1, 5))})


# -- config and preflight -------------------------------------------------------------------

@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "nsfw", "backend": "transformers", "model": "x"}, "needs model and label"),
    ({"name": "a", "backend": "clip-head"}, "needs path"),
    ({"name": "a", "backend": "clip-head", "path": "h.pth", "drop_below": 5},
     "needs status"),
    ({"name": "a", "backend": "clip-head", "path": "h.pth", "status": "unsafe"},
     "drops nothing"),
    ({"name": "a", "backend": "clip-head", "path": "h.pth", "drop_below": 5,
      "status": "too_small"}, "status"),
    ({"name": "Bad-Name", "backend": "clip-head", "path": "h.pth"}, "name"),
    ({"name": "clip", "backend": "clip-head", "path": "h.pth"}, "clip_score is already"),
])
def test_config_names_what_a_classifier_lacks(tmp_path, models, entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_cfg(tmp_path, models, [entry]))


def test_the_config_offers_exactly_the_classifier_statuses():
    from typing import get_args

    from pairforge.config import ClassifierConfig
    from pairforge.records import CLASSIFIER_STATUSES, STATUS_HELP

    offered = set(get_args(get_args(ClassifierConfig.model_fields["status"].annotation)[0]))
    assert offered == {s.value for s in CLASSIFIER_STATUSES}
    assert all(STATUS_HELP[s] for s in CLASSIFIER_STATUSES)


def test_config_refuses_twin_names_and_a_head_without_clip(tmp_path, models):
    head = {"name": "a", "backend": "clip-head", "path": "h.pth"}
    with pytest.raises(ConfigError, match="a repeated"):
        parse_config(_cfg(tmp_path, models, [head, head]))
    with pytest.raises(ConfigError, match="set clip.enabled"):
        parse_config(_cfg(tmp_path, models, [head], enabled=False))


def test_preflight_names_the_labels_and_the_embedding_size(tmp_path, models):
    from pairforge.pipeline.preflight import check_model_sources

    cfg = parse_config(_cfg(tmp_path, models, [
        {"name": "nsfw", "backend": "transformers", "model": models["nsfw"], "label": "porn"},
        {"name": "wide", "backend": "clip-head", "path": models["linear48"]},
        {"name": "gone", "backend": "clip-head", "path": str(tmp_path / "no.pth")},
        {"name": "ok", "backend": "clip-head", "path": models["aesthetic"]},
        {"name": "moved", "backend": "transformers", "model": str(tmp_path / "no_model"),
         "label": "nsfw"}]))
    with pytest.raises(ConfigError) as err:
        check_model_sources(cfg)
    text = str(err.value)
    assert f"process.classifiers[4] (moved).model: {tmp_path / 'no_model'}" in text
    assert "process.classifiers[0] (nsfw).label" in text
    assert "has no label 'porn'; its labels are 'normal', 'nsfw'" in text
    assert ("process.classifiers[1] (wide).path: the head takes 48-dim embeddings but "
            "process.clip.model pf-golden-clip makes 32-dim ones") in text
    assert f"process.classifiers[2] (gone).path: {tmp_path / 'no.pth'} is not a file" in text
    assert "(ok)" not in text


def test_settings_name_each_classifier_and_fingerprint_its_files(tmp_path, models):
    from pairforge.pipeline.settings import stage_settings

    entry = {"name": "aesthetic", "backend": "clip-head", "path": models["aesthetic"],
             "drop_below": 0.1, "status": "low_aesthetic", "pool_size": 2}
    values = stage_settings(parse_config(_cfg(tmp_path, models, [entry])), "process")
    assert values["process.classifiers.aesthetic.drop_below"] == 0.1
    assert "process.classifiers.aesthetic.path#files" in values
    assert not any(k.endswith("pool_size") for k in values)  # speed, not output
    none = stage_settings(parse_config(_cfg(tmp_path, models, [])), "process")
    assert not any(k.startswith("process.classifiers") for k in none)  # older shards' digest


# -- the steps, in process ------------------------------------------------------------------

def _coco_rows() -> list[tuple[str, str]]:
    with open(COCO_CAPTIONS, newline="") as f:
        return [(r["filename"], r["caption"].strip()) for r in csv.DictReader(f)][:N_IMAGES]


def _raw_table(raw: Path) -> pa.Table:
    """Every raw sample as a step sees it: key, caption, status, image bytes."""
    tars = sorted(str(p) for p in raw.glob("*.tar"))
    samples = list(wds.WebDataset(tars, shardshuffle=False))
    return pa.table({"key": [s["__key__"] for s in samples],
                     "caption": [s["txt"].decode() for s in samples],
                     "status": ["ok"] * len(samples), "error": [None] * len(samples),
                     "image": pa.array([s["jpg"] for s in samples], pa.binary())})


def _bare_transformers(folder: str, label: int, images: list[bytes]) -> np.ndarray:
    """A plain transformers loop: the processor and model, softmax, one image at a time."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from pairforge.images import decode_rgb

    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    scores = []
    for data in images:
        with torch.no_grad():
            logits = model(**processor(images=decode_rgb(data), return_tensors="pt")).logits
        scores.append(float(logits.softmax(-1)[0, label]))
    return np.asarray(scores, np.float32)


def _bare_heads(models: dict, images: list[bytes]) -> dict[str, np.ndarray]:
    """open_clip's normalised image embedding, then the heads as torch modules."""
    import open_clip
    import torch

    from pairforge.images import decode_rgb

    open_clip.add_model_config(models["clip"]["model_config_path"])
    model, _, preprocess = open_clip.create_model_and_transforms(
        models["clip"]["model"], pretrained=models["clip"]["pretrained"])
    model.eval()
    with torch.no_grad():
        emb = model.encode_image(torch.stack([preprocess(decode_rgb(b)) for b in images]))
        emb = torch.nn.functional.normalize(emb, dim=-1)
        return {"aesthetic": models["aesthetic_module"](emb)[:, 0].numpy()}


def _cut(scores: np.ndarray, low: float, high: float) -> float:
    """A threshold between two neighbouring scores, at the widest gap between the ``low``
    and ``high`` quantiles: clear of float noise, so the expected drops are certain."""
    ordered = np.sort(scores)
    lo, hi = int(len(ordered) * low), int(len(ordered) * high)
    gaps = np.diff(ordered[lo:hi + 1])
    at = lo + int(np.argmax(gaps))
    assert gaps.max() > 1e-4, "the random model's scores are too close together"
    return float((ordered[at] + ordered[at + 1]) / 2)


@pytest.fixture(scope="module")
def raw(tmp_path_factory, coco_server, ray_local) -> Path:
    """Raw shards (stage 1 over loopback) of 24 COCO photos, a short caption and a 404."""
    photos = _coco_rows()
    rows = [(coco_server.url("/img/" + name), caption) for name, caption in photos]
    rows[5] = (coco_server.url("/img/" + photos[4][0]), "tiny")  # fails the word count
    rows[9] = (coco_server.url("/status/404"), "gone")
    return download_raw(tmp_path_factory.mktemp("classifier_raw"), rows, shard_size=12)


def test_watermark_step_drops_above_its_bound_with_its_status(raw, models, tmp_path):
    from pairforge.filters.classify import classifier_steps

    table = _raw_table(raw / "raw")
    bare = _bare_transformers(models["watermark"], 1, table["image"].to_pylist())
    bound = _cut(bare, 0.5, 0.8)
    cfg = parse_config(_cfg(tmp_path, models, [
        {"name": "watermark", "backend": "transformers", "model": models["watermark"],
         "label": "watermark", "drop_above": bound, "status": "watermarked"}]))
    (step_cls,) = classifier_steps(cfg.process.classifiers)
    assert step_cls.name == "classifier.watermark" and step_cls.requires == ("image",)
    result = step_cls(cfg)(table)
    scores = np.asarray(result["watermark_score"].to_pylist())
    np.testing.assert_allclose(scores, bare, atol=1e-5)
    statuses = result["status"].to_pylist()
    assert statuses == ["watermarked" if s > bound else "ok" for s in bare]
    assert 0 < statuses.count("watermarked") < len(statuses)
    error = result["error"].to_pylist()[statuses.index("watermarked")]
    assert error.startswith("watermark_score 0.") and f"> {bound} (watermark)" in error


def test_a_head_step_reads_the_embedding_not_the_image(models, tmp_path):
    from pairforge.filters.classify import classifier_steps

    cfg = parse_config(_cfg(tmp_path, models, [  # a plain nn.Linear, score only
        {"name": "linear", "backend": "clip-head", "path": models["linear"]}]))
    (step_cls,) = classifier_steps(cfg.process.classifiers)
    assert step_cls.requires == ("clip_embedding",) and step_cls.ends == ()
    emb = np.random.default_rng(1).normal(size=(3, 32)).astype(np.float32)
    rows = pa.table({"key": ["a", "b", "c"], "status": ["ok"] * 3, "error": [None] * 3,
                     "clip_embedding": pa.array(emb.tolist(), pa.list_(pa.float32()))})
    result = step_cls(cfg)(rows)  # no image column at all: there is no second image pass
    import torch

    with torch.no_grad():
        expected = models["linear_module"](torch.from_numpy(emb))[:, 0].numpy()
    np.testing.assert_allclose(result["linear_score"].to_pylist(), expected, atol=1e-6)
    assert result["status"].to_pylist() == ["ok"] * 3


def test_the_second_pass_encodes_only_rows_the_scoring_pass_did_not(models, raw, tmp_path):
    """top_fraction mode with a clip-head: the scoring pass saved every scored row's
    embedding; the second pass reads them with the cached scores (pipeline/stream.py), so
    CLIP encodes only a row that has none."""
    import shutil

    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.contract import step_config
    from pairforge.pipeline.plan import Decisions
    from pairforge.pipeline.stream import load_rows
    from pairforge.shards.storage import OutputDir
    from pairforge.shards.training import write_embeddings

    out = tmp_path / "out"
    shutil.copytree(raw / "raw", out / "raw")
    cfg = parse_config(_cfg(out, models, [
        {"name": "linear", "backend": "clip-head", "path": models["linear"]}],
        mode="top_fraction"))
    step = ClipStep(step_config(cfg))
    first = load_rows(pa.table({"shard": [0]}), str(out), {}, Decisions(()))
    keys = first["key"].to_pylist()
    scored = step(first.slice(1))  # the scoring pass, one row short of the shard
    (out / "clip").mkdir()
    pq.write_table(scored.select(["key", "clip_score"]), out / "clip" / "00000.parquet")
    write_embeddings(OutputDir(str(out)), 0, keys[1:], scored["clip_embedding"].to_pylist())

    second = load_rows(pa.table({"shard": [0]}), str(out), {}, Decisions(()),
                       "clip_score", "clip_embedding")
    assert second["clip_embedding"].to_pylist()[1:] == scored["clip_embedding"].to_pylist()
    assert second["clip_embedding"][0].as_py() is None
    encoded = []
    embed_view = step.scorer.embed_view  # what the step encodes its pictures with
    step.scorer.embed_view = lambda pictures: encoded.append(len(pictures)) or embed_view(
        pictures)
    result = step(second)
    assert encoded == [1]  # the one row the scoring pass did not embed
    assert result["clip_embedding"].to_pylist()[1:] == scored["clip_embedding"].to_pylist()
    assert result["clip_score"].to_pylist()[1:] == scored["clip_score"].to_pylist()
    fresh = step(first.slice(0, 1))
    np.testing.assert_allclose(result["clip_embedding"][0].as_py(),
                               fresh["clip_embedding"][0].as_py(), atol=1e-6)


def test_steps_sharing_a_status_count_their_own_drops(models, tmp_path):
    from pairforge.filters.classify import classifier_steps
    from pairforge.stage import SECONDS_PREFIX, step_stats

    entries = [{"name": n, "backend": "clip-head", "path": models["linear"], "drop_above": 0,
                "status": "unsafe"} for n in ("first", "second")]
    first, second = classifier_steps(parse_config(_cfg(tmp_path, models, entries))
                                     .process.classifiers)
    a, b = SECONDS_PREFIX + first.name, SECONDS_PREFIX + second.name
    rows = [{"status": "unsafe", a: 0.1, b: None},  # the first one dropped it
            {"status": "unsafe", a: 0.1, b: 0.1},  # the second one did
            {"status": "ok", a: 0.1, b: 0.1}]
    stats = step_stats([first, second], 3, rows)
    assert stats[first.name] == {"rows_in": 3, "rows_out": 2, "ended": {"unsafe": 1},
                                 "seconds": 0.3}
    assert stats[second.name]["rows_in"] == 2 and stats[second.name]["ended"] == {"unsafe": 1}


# -- a build on local Ray -------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(raw, models, tmp_path_factory) -> dict:
    """Stage 3 with CLIP (score only), an NSFW classifier (transformers) dropping above a
    bound and LAION's aesthetic head dropping below one; the bounds cut the bare loops'
    scores where known rows fall on each side."""
    import shutil

    from pairforge.pipeline.entry import RunOptions
    from pairforge.pipeline.process import run_process

    table = _raw_table(raw / "raw")
    keys, images = table["key"].to_pylist(), table["image"].to_pylist()
    nsfw = _bare_transformers(models["nsfw"], 1, images)
    heads = _bare_heads(models, images)
    eligible = [i for i, k in enumerate(keys) if k != "000000005"]  # 'tiny' fails basic
    nsfw_bound = _cut(nsfw[eligible], 0.6, 0.85)
    survivors = [i for i in eligible if nsfw[i] <= nsfw_bound]
    aesthetic_bound = _cut(heads["aesthetic"][survivors], 0.2, 0.5)
    expected = {keys[i]: "ok" for i in survivors if heads["aesthetic"][i] >= aesthetic_bound}
    expected.update({keys[i]: "low_aesthetic" for i in survivors if keys[i] not in expected})
    expected.update({keys[i]: "unsafe" for i in eligible if i not in survivors})
    out = tmp_path_factory.mktemp("classifier_build") / "out"
    shutil.copytree(raw / "raw", out / "raw")
    cfg = parse_config(_cfg(out, models, [
        {"name": "nsfw", "backend": "transformers", "model": models["nsfw"], "label": "nsfw",
         "drop_above": nsfw_bound, "status": "unsafe", "batch_size": 8},
        {"name": "aesthetic", "backend": "clip-head", "path": models["aesthetic"],
         "drop_below": aesthetic_bound, "status": "low_aesthetic"}]))
    summary = run_process(cfg, RunOptions(show_progress=False))
    return {"out": out, "summary": summary, "expected": expected,
            "bare": {k: {"nsfw": nsfw[i], "aesthetic": heads["aesthetic"][i]}
                     for i, k in enumerate(keys)}}


def _parquet_rows(out: Path) -> dict[str, dict]:
    table = pq.read_table(sorted((out / "shards").glob("*.parquet")))
    return {r["key"]: r for r in table.to_pylist()}


def test_the_build_drops_known_rows_with_their_status_and_keeps_the_scores(built):
    rows = _parquet_rows(built["out"])
    assert len(rows) == N_IMAGES
    assert rows["000000005"]["status"] == "caption_too_short"
    assert rows["000000009"]["status"] == "http_error"
    found = {k: r["status"] for k, r in rows.items() if k in built["expected"]}
    assert found == built["expected"]
    statuses = list(found.values())
    assert statuses.count("unsafe") >= 2 and statuses.count("low_aesthetic") >= 2
    assert statuses.count("ok") >= 5
    for key, status in built["expected"].items():
        row, bare = rows[key], built["bare"][key]
        assert row["nsfw_score"] == pytest.approx(bare["nsfw"], abs=1e-5)
        if status == "unsafe":  # later classifiers never saw it
            assert row["aesthetic_score"] is None
            assert row["error"].startswith("nsfw_score ")
            continue
        assert row["aesthetic_score"] == pytest.approx(bare["aesthetic"], abs=1e-5)
    schema = pq.read_schema(built["out"] / "shards" / "00000.parquet")
    assert {schema.field(f"{n}_score").type for n in ("nsfw", "aesthetic")} == {pa.float32()}
    assert not (built["out"] / "embeddings").exists()  # kept for the heads only


def test_kept_samples_carry_every_score_typed_alike(built):
    out = built["out"]
    rows = _parquet_rows(out)
    tars = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    samples = list(wds.WebDataset(tars, shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == sorted(
        k for k, s in built["expected"].items() if s == "ok")
    for sample in samples:
        meta = sample["json"]
        for name in ("nsfw", "aesthetic"):
            value = meta[f"{name}_score"]
            assert isinstance(value, float)
            assert value == pytest.approx(rows[sample["__key__"]][f"{name}_score"], abs=1e-6)
    features = json.loads((out / "features.json").read_text())["json"]
    assert {features[f"{n}_score"]["dtype"] for n in ("nsfw", "aesthetic")} == {"float64"}


def test_manifest_inspect_report_and_show_cover_the_classifiers(built, tmp_path):
    from rich.console import Console

    from pairforge.inspection.contact_sheet import show
    from pairforge.inspection.report import render_report
    from pairforge.inspection.summary import inspect_view

    out, expected = built["out"], built["expected"]
    unsafe = sum(s == "unsafe" for s in expected.values())
    low = sum(s == "low_aesthetic" for s in expected.values())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["steps"]["classifier.nsfw"]["ended"] == {"unsafe": unsafe}
    assert manifest["steps"]["classifier.aesthetic"]["ended"] == {"low_aesthetic": low}
    assert manifest["funnel"]["final"]["unsafe"] == unsafe
    nsfw = manifest["classifiers"][0]
    assert (nsfw["name"], nsfw["status"], nsfw["rows_dropped"]) == ("nsfw", "unsafe", unsafe)
    console = Console(record=True, width=220)
    console.print(inspect_view(str(out)))
    text = console.export_text()
    assert "low_aesthetic" in text and "below its drop_below" in text
    assert "classifier nsfw: transformers" in text and f"{unsafe} of " in text
    page = render_report(str(out))
    # funnel, CLIP, one histogram per classifier score (no tokens here)
    assert page.count("data:image/png;base64,") == 4
    from pairforge.inspection.verify import verify_dataset

    assert verify_dataset(str(out)) == []
    sheet = tmp_path / "unsafe.png"
    assert show(str(out), str(sheet), status="unsafe", n=16) == min(unsafe, 16)
    assert sheet.stat().st_size > 0
    with pytest.raises(ConfigError, match="not a status"):
        show(str(out), str(sheet), status="nsfw")
