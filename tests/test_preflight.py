"""pairforge/pipeline/preflight.py: a model that cannot load is named before any work starts.

No request is made anywhere here: a hub id is recognised by its form only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import pairforge
from pairforge.config import ConfigError, PairforgeConfig, parse_config
from pairforge.pipeline.preflight import check_model_sources

SAMPLE = Path(pairforge.__file__).parent / "sample"
NO_GROUNDING = {"grounding": {"enabled": False}}


def _cfg(process: dict) -> PairforgeConfig:
    return parse_config({"input": {"path": "unused"}, "process": process})


def _problems(process: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        check_model_sources(_cfg(process))
    first, *lines = str(err.value).splitlines()
    assert first == "a model cannot be found:"
    return [line.strip() for line in lines]


def _tokenize(image: dict, text: dict | None = None) -> dict:
    return {"tokenize": {"enabled": True, "image": image, **({"text": text} if text else {})}}


def test_the_bundled_models_pass():
    check_model_sources(_cfg({
        **_tokenize({"path_or_id": str(SAMPLE / "vq32")},
                    {"backend": "hf", "path_or_id": str(SAMPLE / "captioner")}),
        "recaption": {"enabled": True, "model": str(SAMPLE / "captioner"), **NO_GROUNDING}}))


def test_a_missing_checkpoint_of_ours_is_named_even_when_it_looks_like_a_hub_id(tmp_path):
    assert _problems(_tokenize({"path_or_id": str(tmp_path / "vq64")})) == [
        f"process.tokenize.image.path_or_id: {tmp_path / 'vq64'} is not a folder"]
    assert _problems(_tokenize({"path_or_id": "org/vq64"})) == [
        "process.tokenize.image.path_or_id: org/vq64 is not a folder"]


def test_a_folder_without_the_loaders_files_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _problems(_tokenize({"path_or_id": str(tmp_path)})) == [
        f"process.tokenize.image.path_or_id: {tmp_path} has no model.safetensors"]


def test_every_problem_is_listed_at_once(tmp_path):
    problems = _problems({
        **_tokenize({"backend": "janus", "path_or_id": "./models/janus"},
                    {"backend": "hf", "path_or_id": str(tmp_path)}),
        "recaption": {"enabled": True, "model": "~/models/vlm", **NO_GROUNDING}})
    assert problems == [
        "process.tokenize.image.path_or_id: ./models/janus is not a folder (and is not a hub id)",
        f"process.tokenize.text.path_or_id: {tmp_path} has no tokenizer.json or "
        "tokenizer_config.json",
        "process.recaption.model: ~/models/vlm is not a folder (and is not a hub id)"]


def test_hub_ids_are_left_to_the_loader():
    check_model_sources(_cfg({
        **_tokenize({"backend": "emu3", "path_or_id": "BAAI/Emu3-VisionTokenizer"},
                    {"backend": "hf", "path_or_id": "gpt2"}),
        "recaption": {"enabled": True, "model": "HuggingFaceTB/SmolVLM-256M-Instruct",
                      **NO_GROUNDING}}))


def test_clip_names_tags_and_checkpoint_files_are_checked(tmp_path):
    assert _problems({"clip": {"enabled": True, "model": "ViT-Q-99"}}) == [
        "process.clip.model: 'ViT-Q-99' is neither an open_clip model nor in "
        "process.clip.model_config_path"]
    [typo] = _problems({"clip": {"enabled": True, "pretrained": "laion2b_s34b_b78k"}})
    assert typo.startswith("process.clip.pretrained: 'laion2b_s34b_b78k' is not a tag of "
                           "ViT-B-32 (open_clip knows openai, ")
    assert "laion2b_s34b_b79k" in typo
    assert _problems({"clip": {"enabled": True, "pretrained": str(tmp_path / "clip.pt")}}) == [
        f"process.clip.pretrained: {tmp_path / 'clip.pt'} is not a file"]
    assert _problems({"clip": {"enabled": True, "model": "pf-clip", "pretrained": None,
                               "model_config_path": str(tmp_path / "pf-clip.json")}}) == [
        f"process.clip.model_config_path: {tmp_path / 'pf-clip.json'} does not exist",
        "process.clip.model: 'pf-clip' is neither an open_clip model nor in "
        "process.clip.model_config_path"]


def test_clip_models_that_can_load_pass(tmp_path):
    (tmp_path / "pf-clip.json").write_text("{}")
    (tmp_path / "weights.pt").write_bytes(b"")
    for clip in ({}, {"model": "pf-clip", "model_config_path": str(tmp_path / "pf-clip.json"),
                      "pretrained": str(tmp_path / "weights.pt")},
                 {"model": "pf-clip", "model_config_path": str(tmp_path), "pretrained": None},
                 {"model": "hf-hub:org/clip", "pretrained": None}):
        check_model_sources(_cfg({"clip": {"enabled": True, **clip}}))


def test_grounding_checks_the_clip_model_with_the_clip_filter_off():
    problems = _problems({"clip": {"pretrained": "no-such-tag"},
                          "recaption": {"enabled": True, "model": str(SAMPLE / "captioner")}})
    assert [p.split(":")[0] for p in problems] == ["process.clip.pretrained"]
    check_model_sources(_cfg({"clip": {"pretrained": "no-such-tag"}}))  # nothing uses CLIP


def test_build_stops_before_downloading_anything(tmp_path):
    # 127.0.0.1:9 (discard) is never asked: the build must stop before stage 1
    (tmp_path / "in.csv").write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a cat on a mat\n")
    config = {"input": {"path": str(tmp_path / "in.csv")},
              "output": {"path": str(tmp_path / "out")},
              "process": _tokenize({"path_or_id": str(tmp_path / "vq")})}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                             str(tmp_path / "c.yaml"), "-q"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "process.tokenize.image.path_or_id" in result.stderr + result.stdout
    assert not (tmp_path / "out" / "raw").exists()
